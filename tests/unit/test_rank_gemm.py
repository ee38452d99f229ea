"""`rank_product` / `write_product`: products with a LoRA rank's few output columns, transposed on CPU."""

from __future__ import annotations

import pytest
import torch

from worker.engine.rank_gemm import NARROW_BELOW, rank_product, write_product


def _operands(batch: int | None, rank: int, rows: int = 24) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(rank)
    lead = () if batch is None else (batch,)
    return torch.randn(*lead, rows, 40, generator=gen), torch.randn(*lead, 40, rank, generator=gen)


@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize("rank", [2, 8, NARROW_BELOW - 1, NARROW_BELOW, 32])
def test_rank_product_is_the_product_and_narrow_ranks_come_transposed(batch: int | None, rank: int) -> None:
    a, b = _operands(batch, rank)
    got = rank_product(a, b)
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)
    narrow = rank < NARROW_BELOW
    # Narrow: computed as (bᵀ aᵀ)ᵀ, so the result is the transpose of a contiguous product.
    assert got.is_contiguous() is not narrow
    assert got.mT.is_contiguous() is narrow


@pytest.mark.parametrize("batch", [None, 8])
@pytest.mark.parametrize("rows", [1, 4, NARROW_BELOW - 1])
def test_few_rows_keep_the_direct_product(batch: int | None, rows: int) -> None:
    """A decode step's few rows per adapter: transposing would give an output no wider than the rank, and its
    view would send the next GEMM (`baddbmm_` into the base output) off its fast path."""
    a, b = _operands(batch, 8, rows=rows)
    got = rank_product(a, b)
    torch.testing.assert_close(got, a @ b, rtol=1e-5, atol=1e-5)
    assert got.is_contiguous()


@pytest.mark.parametrize("batch", [None, 3])
@pytest.mark.parametrize("rank", [8, 32])
@pytest.mark.parametrize("accumulate", [False, True])
def test_write_product_writes_or_adds_into_the_rows(batch: int | None, rank: int, accumulate: bool) -> None:
    a, b = _operands(batch, rank)
    before = torch.full_like(a @ b, 0.5)
    rows = before.clone()
    pointer = rows.data_ptr()
    write_product(a, b, rows, accumulate=accumulate)
    expected = before + a @ b if accumulate else a @ b
    torch.testing.assert_close(rows, expected, rtol=1e-5, atol=1e-5)
    assert rows.data_ptr() == pointer and rows.is_contiguous()  # in place: the bank's own storage


def test_gradients_flow_through_the_transposed_product() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(2, NARROW_BELOW, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(2, 6, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    assert not rank_product(a, b).is_contiguous()  # the transposed path is the one checked
    assert torch.autograd.gradcheck(rank_product, (a, b))


@pytest.mark.parametrize("rank", [8, 32])
def test_batches_go_straight_to_bmm(rank: int) -> None:
    """A grouped pass makes about 200 batched rank products: `@` on 3-d operands dispatches through `matmul`,
    which expands and reshapes both operands and views the result back, four more ops per product."""
    a, b = _operands(3, rank)
    with torch.profiler.profile() as prof:
        rank_product(a, b)
    ops = {event.key for event in prof.key_averages()}
    assert "aten::bmm" in ops
    assert not ops & {"aten::matmul", "aten::expand", "aten::_unsafe_view"}
