"""Padding-free attention for packed passes, registered with transformers as `carpool`.

In a packed pass many sequences lie end to end in one row; attention must never cross a sequence
boundary. Rather than a (T x T) block-diagonal mask (quadratic in the *packed* length), we split the
row at the boundaries the pass plan records and run causal SDPA per sequence, batching sequences of
equal length together. Outside packed passes (sampling with a KV cache) it defers to transformers' SDPA.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

from worker.engine.passes import PassContext

ATTN_IMPLEMENTATION = "carpool"


def register_packed_attention(ctx: PassContext) -> str:
    """Register the packed attention bound to `ctx`; returns the `attn_implementation` name to load with."""

    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                  attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
        plan = ctx.current
        if plan is None or plan.seq_lens is None:
            return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
        return packed_causal_attention(query, key, value, plan.seq_lens, kwargs.get("scaling")), None

    def mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
        plan = ctx.current
        if plan is not None and plan.seq_lens is not None:
            return None  # boundaries come from the plan, not from a quadratic mask
        return sdpa_mask(*args, **kwargs)

    name = f"{ATTN_IMPLEMENTATION}_{id(ctx):x}"
    AttentionInterface.register(name, attention)
    ALL_MASK_ATTENTION_FUNCTIONS.register(name, mask)
    return name


def packed_causal_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            seq_lens: list[int], scaling: float | None) -> torch.Tensor:
    """query (1, H, T, D), key/value (1, Hkv, T, D) → (1, T, H, D), causal within each sequence."""
    if query.shape[0] != 1:
        raise ValueError("packed attention expects one packed row")
    gqa = query.shape[1] != key.shape[1]
    if len(set(seq_lens)) == 1:
        out = _equal_lengths(query, key, value, seq_lens[0], len(seq_lens), scaling, gqa)
    else:
        outs = []
        start = 0
        for n in seq_lens:
            q, k, v = (t[:, :, start : start + n] for t in (query, key, value))
            outs.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa))
            start += n
        out = torch.cat(outs, dim=2)
    return out.transpose(1, 2).contiguous()


def _equal_lengths(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, length: int, count: int,
                   scaling: float | None, gqa: bool) -> torch.Tensor:
    def split(t: torch.Tensor) -> torch.Tensor:
        # (1, H, count*L, D) → (count, H, L, D)
        return t.reshape(t.shape[1], count, length, t.shape[-1]).transpose(0, 1)

    out = F.scaled_dot_product_attention(split(query), split(key), split(value), is_causal=True,
                                         scale=scaling, enable_gqa=gqa)
    # (count, H, L, D) → (1, H, count*L, D)
    return out.transpose(0, 1).reshape(1, out.shape[1], count * length, out.shape[-1])
