"""Tiny random-weight Qwen3 causal LMs for development and tests, built entirely offline.

`build_dev_model` owns the whole recipe: a byte-level BPE tokenizer trained on a built-in corpus, a
Qwen3 config sized to that tokenizer, seeded random weights, and a ChatML chat template. The result is
an ordinary Hugging Face directory (config, safetensors, tokenizer) that `AutoModelForCausalLM` and
`AutoTokenizer` load without a hub, so the rest of Carpool can treat it like any real base model.
"""

from __future__ import annotations

import contextlib
import string
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import GenerationConfig, PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM
from transformers.utils import logging as hf_logging

ENDOFTEXT = "<|endoftext|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS: tuple[str, ...] = (ENDOFTEXT, IM_START, IM_END)

# ChatML, the format Qwen and SmolLM2-Instruct use; shared with `worker.models.sources` for GGUF
# tokenizers that arrive without a template.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# 256 byte-level symbols plus the special tokens: a smaller vocabulary could not encode every byte.
MIN_VOCAB = 256 + len(SPECIAL_TOKENS)

_CORPUS: tuple[str, ...] = (
    "The quick brown fox jumps over the lazy dog. A small model learns the shape of language from "
    "many short sentences, one token at a time, and it is wrong often before it is right.",
    "Once upon a time there was a little village near a river. Every morning the people walked to "
    "the market, bought bread and fish, and talked about the weather, their children and the news.",
    "To train a model, we compute the loss on a batch of examples, take the gradient with respect to "
    "the parameters, and move each parameter a small step in the direction that lowers the loss.",
    "User: What is the capital of France?\nAssistant: The capital of France is Paris. It is known "
    "for its museums, its cafes and the tower that stands beside the river Seine.",
    "Numbers and dates appear in text too: 1, 2, 3, 10, 42, 100, 2024, 3.14, and 99%. Lists are "
    "written as first, second and third; questions end with a question mark, don't they?",
    "She said that the results were good, but he thought they could be better. They agreed to run "
    "the experiment again tomorrow with more data, a lower learning rate and a fixed random seed.",
    "def add(a, b):\n    return a + b\n\nfor i in range(10):\n    print(add(i, i * 2))\n",
    "In the spring the trees turn green, in the summer the days are long and warm, in the autumn "
    "the leaves fall, and in the winter the nights are cold and the snow covers the hills.",
    # Printable ASCII, so every common character is seen by the trainer at least once.
    string.printable,
)


def build_dev_model(
    path: Path,
    *,
    layers: int = 2,
    hidden: int = 64,
    vocab: int = 512,
    seed: int = 0,
    heads: int | None = None,
    kv_heads: int | None = None,
    intermediate: int | None = None,
    max_positions: int = 2048,
) -> Path:
    """Write a random-weight Qwen3 causal LM and its tokenizer to `path`; same arguments, same bytes."""
    path = Path(path)
    tokenizer = _build_tokenizer(vocab, max_positions)
    config = _build_config(
        tokenizer,
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        intermediate=intermediate,
        max_positions=max_positions,
    )
    model = _init_model(config, seed)
    path.mkdir(parents=True, exist_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return path


def default_head_dim(hidden: int) -> int:
    """Pick a head size that keeps tiny models multi-headed and larger ones at realistic widths."""
    if hidden <= 128:
        return 16
    return 32 if hidden <= 512 else 64


def _train_bpe(vocab: int) -> Tokenizer:
    if vocab < MIN_VOCAB:
        raise ValueError(f"vocab must be at least {MIN_VOCAB} (256 bytes + special tokens), got {vocab}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet is what makes any input, not just the corpus, encodable.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    _pad_vocab(tok, vocab)
    return tok


def _pad_vocab(tok: Tokenizer, vocab: int) -> None:
    """Top up with reserved tokens when the small corpus runs out of merges before `vocab`."""
    missing = vocab - tok.get_vocab_size(with_added_tokens=True)
    if missing > 0:
        base = tok.get_vocab_size(with_added_tokens=True)
        tok.add_special_tokens([f"<|reserved_{base + i}|>" for i in range(missing)])
    size = tok.get_vocab_size(with_added_tokens=True)
    if size != vocab:
        raise RuntimeError(f"tokenizer came out with {size} tokens, wanted exactly {vocab}")


def _build_tokenizer(vocab: int, max_positions: int) -> PreTrainedTokenizerFast:
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=_train_bpe(vocab),
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        model_max_length=max_positions,
        chat_template=CHATML_TEMPLATE,
    )
    # Without this, `chat_template` passed to the constructor is not kept by every transformers version.
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def _attention_shape(hidden: int, heads: int | None, kv_heads: int | None) -> tuple[int, int, int]:
    """Return (heads, kv_heads, head_dim), defaulting to grouped-query attention with two groups."""
    if heads is None:
        head_dim = default_head_dim(hidden)
        if hidden % head_dim:
            raise ValueError(f"hidden={hidden} is not a multiple of the default head_dim {head_dim}")
        heads = hidden // head_dim
    elif heads <= 0 or hidden % heads:
        raise ValueError(f"hidden={hidden} must be a positive multiple of heads={heads}")
    if kv_heads is None:
        kv_heads = heads // 2 if heads % 2 == 0 else heads
    if kv_heads <= 0 or heads % kv_heads:
        raise ValueError(f"heads={heads} must be a positive multiple of kv_heads={kv_heads}")
    return heads, kv_heads, hidden // heads


def _build_config(
    tokenizer: PreTrainedTokenizerFast,
    *,
    layers: int,
    hidden: int,
    heads: int | None,
    kv_heads: int | None,
    intermediate: int | None,
    max_positions: int,
) -> Qwen3Config:
    n_heads, n_kv, head_dim = _attention_shape(hidden, heads, kv_heads)
    eos, pad = tokenizer.convert_tokens_to_ids([IM_END, ENDOFTEXT])
    return Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        # Qwen3's MLP is about 3x the hidden width.
        intermediate_size=intermediate or 3 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_kv,
        head_dim=head_dim,
        max_position_embeddings=max_positions,
        tie_word_embeddings=False,
        # Qwen3's defaults point at ids of its 151k vocabulary; these must be ours.
        bos_token_id=pad,
        eos_token_id=eos,
        pad_token_id=pad,
        dtype="float32",
    )


def _init_model(config: Qwen3Config, seed: int) -> Qwen3ForCausalLM:
    # fork_rng keeps the caller's global RNG untouched while making the init depend on `seed` alone.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config).to(torch.float32)
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    return model.eval()


@contextlib.contextmanager
def _quiet_progress_bars() -> Iterator[None]:
    """Silence transformers' save progress bars: this builder promises to print nothing."""
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
