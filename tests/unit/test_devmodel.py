"""Tests for the offline dev-model builder (`worker.models.devmodel`) and the `carpool dev-model` command."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel
from typer.testing import CliRunner

from deploy.cli import app
from worker.models.devmodel import IM_END, build_dev_model


@pytest.fixture(scope="module")
def dev_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_dev_model(tmp_path_factory.mktemp("dev") / "model")


def _load(path: Path) -> PreTrainedModel:
    return AutoModelForCausalLM.from_pretrained(path)


def test_loads_as_qwen3_with_matching_vocab(dev_dir: Path) -> None:
    model = _load(dev_dir)
    tokenizer = AutoTokenizer.from_pretrained(dev_dir)
    assert model.config.model_type == "qwen3"
    assert model.config.vocab_size == len(tokenizer) == 512
    assert model.get_input_embeddings().weight.shape[0] == 512
    assert not model.config.tie_word_embeddings
    assert model.dtype == torch.float32


def test_special_tokens_wired_into_configs(dev_dir: Path) -> None:
    model = _load(dev_dir)
    tokenizer = AutoTokenizer.from_pretrained(dev_dir)
    assert tokenizer.eos_token == IM_END
    assert tokenizer.pad_token == "<|endoftext|>"
    for cfg in (model.config, model.generation_config):
        assert cfg.eos_token_id == tokenizer.eos_token_id
        assert cfg.pad_token_id == tokenizer.pad_token_id


def test_chat_template_renders_chatml(dev_dir: Path) -> None:
    tokenizer = AutoTokenizer.from_pretrained(dev_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tokenizer(text)["input_ids"]
    assert tokenizer.convert_tokens_to_ids(IM_END) in ids


ROUND_TRIP_TEXTS = ["The quick brown fox.", "naïve café 🚀 — ∑\t\nx", "def f():\n    return 1\n"]


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_tokenizer_round_trips(dev_dir: Path, text: str) -> None:
    tokenizer = AutoTokenizer.from_pretrained(dev_dir)
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text


def test_same_seed_gives_identical_files(dev_dir: Path, tmp_path: Path) -> None:
    again = build_dev_model(tmp_path / "again")
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (again / name).read_bytes() == (dev_dir / name).read_bytes(), name


def test_different_seed_gives_different_weights(dev_dir: Path, tmp_path: Path) -> None:
    base = _load(dev_dir).state_dict()
    other = _load(build_dev_model(tmp_path / "other", seed=1)).state_dict()
    assert base.keys() == other.keys()
    assert not torch.equal(base["model.embed_tokens.weight"], other["model.embed_tokens.weight"])


def test_same_seed_gives_identical_state_dict(dev_dir: Path, tmp_path: Path) -> None:
    a = _load(dev_dir).state_dict()
    b = _load(build_dev_model(tmp_path / "b")).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_shape_options_and_forward(tmp_path: Path) -> None:
    path = build_dev_model(tmp_path / "m", layers=3, hidden=256, vocab=1024, heads=4, kv_heads=2)
    model = _load(path)
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (3, 256, 1024)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 64)
    with torch.no_grad():
        logits = model(torch.tensor([[1, 5, 9]])).logits
    assert logits.shape == (1, 3, 1024)


def test_vocab_larger_than_corpus_is_exact(tmp_path: Path) -> None:
    path = build_dev_model(tmp_path / "big", vocab=2000)
    assert len(AutoTokenizer.from_pretrained(path)) == 2000


def test_greedy_generation_runs(dev_dir: Path) -> None:
    model = _load(dev_dir)
    tokenizer = AutoTokenizer.from_pretrained(dev_dir)
    ids = tokenizer("Hello", return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 3)


@pytest.mark.parametrize("kwargs", [{"vocab": 100}, {"hidden": 64, "heads": 5}, {"heads": 4, "kv_heads": 3}])
def test_rejects_bad_shapes(tmp_path: Path, kwargs: dict[str, int]) -> None:
    with pytest.raises(ValueError):
        build_dev_model(tmp_path / "bad", **kwargs)


def test_cli_dev_model(tmp_path: Path) -> None:
    target = tmp_path / "cli-model"
    args = ["dev-model", str(target), "--layers", "1", "--hidden", "32", "--seed", "3"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(target)
    assert _load(target).config.num_hidden_layers == 1


def test_cli_dev_model_bad_vocab_exits_nonzero(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["dev-model", str(tmp_path / "x"), "--vocab", "10"])
    assert result.exit_code == 1
    assert "vocab" in result.output
