"""Products whose output has a LoRA rank's few columns, computed the way the CPU's GEMM runs them fast.

`x @ A.T` (the low-rank activations), `grad_out @ B` (their gradient) and `grad_outᵀ @ h` (B's gradient) all
produce a matrix with `rank` columns. On this project's CPU (oneDNN/MKL, AVX-512) a GEMM with fewer than 16
output columns fills only part of each vector register and ran 2–8 × slower than the same product computed
transposed, `(bᵀ @ aᵀ)ᵀ`, whose output rows are the long side (e.g. `lm_head`'s B gradient, 4096 × 256 × 8:
3.9 ms against 0.46 ms; docs/performance.md, session 28). At rank 16 and above the direct product is as fast
or faster, and a GPU's GEMM takes either layout at full speed, so both keep the direct product.

The transposed form pays only where its own output is wide: the rows of `a` become its columns. With fewer than
16 rows (a decode step's few samples per adapter) it is no faster, and the transposed view it returns sent the
next GEMM, `baddbmm_` adding `h @ Bᵀ` into the base output, off its fast path: 8 adapters × 4 rows, out 768,
99 µs against 14 µs, and a grouped sample batch 24 % dearer in CPU per token (docs/performance.md, session 29).
So the rule looks at both sides of the output.
"""

from __future__ import annotations

import torch

NARROW_BELOW = 16
"""Output columns under which a CPU product is computed transposed, provided the transposed product's own
columns (`a`'s rows) reach it."""


def rank_product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` (matrices or batches of them) where `b`'s last axis is a LoRA rank; on CPU with a rank under
    `NARROW_BELOW` and at least `NARROW_BELOW` rows in `a`, computed as `(bᵀ @ aᵀ)ᵀ` and returned as that
    transposed view (same values)."""
    if _narrow(a, b):
        return _product(b.mT, a.mT).mT
    return _product(a, b)


def _product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    # Batches go straight to `bmm`: `@` on 3-d operands dispatches through `matmul`, which expands and
    # reshapes both and views the result back, four more ops per product (a grouped pass has about 200).
    return torch.bmm(a, b) if a.dim() == 3 and b.dim() == 3 else a @ b


def write_product(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, *, accumulate: bool) -> None:
    """`out = a @ b`, or `out += a @ b` with `accumulate`, for `out` a gradient row (or rows) of a bank."""
    if _narrow(a, b):
        product = rank_product(a, b)
        out.add_(product) if accumulate else out.copy_(product)
    elif accumulate:
        out.baddbmm_(a, b) if out.dim() == 3 else out.addmm_(a, b)
    else:
        torch.matmul(a, b, out=out)


def _narrow(a: torch.Tensor, b: torch.Tensor) -> bool:
    return b.shape[-1] < NARROW_BELOW <= a.shape[-2] and b.is_cpu
