"""Loading a frozen base model from a local directory and fitting it with multi-LoRA layers.

fp32 on CPU, bf16 on CUDA (overridable). The model is put in eval mode for good: the base never
trains, and eval mode keeps dropout off so packed and reference passes compute the same thing.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from worker.engine.attention import register_packed_attention
from worker.engine.lora import MultiLoraLinear, inject_multi_lora
from worker.engine.passes import PassContext

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: nn.Module
    ctx: PassContext
    layers: dict[str, MultiLoraLinear]
    device: torch.device
    dtype: torch.dtype
    vocab_size: int
    max_context: int
    eos_token_ids: tuple[int, ...]
    arch: str


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def load_base_model(model_dir: Path, *, device: torch.device | None = None,
                    dtype: torch.dtype | None = None) -> LoadedModel:
    """Load `model_dir` (config + safetensors), freeze it and wrap its target linears."""
    device = device or default_device()
    dtype = dtype or default_dtype(device)
    ctx = PassContext()
    attn = register_packed_attention(ctx)
    started = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation=attn)
    model.to(device)
    model.eval()
    model.requires_grad_(False)
    layers = inject_multi_lora(model, ctx)
    config = AutoConfig.from_pretrained(model_dir)
    log.info("loaded base model %s (%s, %s) in %.1fs", model_dir, device, dtype, time.perf_counter() - started)
    return LoadedModel(
        model=model, ctx=ctx, layers=layers, device=device, dtype=dtype,
        vocab_size=int(config.vocab_size),
        max_context=int(getattr(config, "max_position_embeddings", 2048)),
        eos_token_ids=_eos_ids(model_dir, config),
        arch=(config.architectures or [type(model).__name__])[0],
    )


def _eos_ids(model_dir: Path, config: object) -> tuple[int, ...]:
    ids: list[int] = []
    sources: list[object] = [getattr(config, "eos_token_id", None)]
    # No generation_config.json: the model config's eos is all there is.
    with contextlib.suppress(OSError):
        sources.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    for value in sources:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list | tuple):
            ids.extend(int(v) for v in value)
    return tuple(dict.fromkeys(ids))
