"""Where a CPU worker keeps the adapters beyond its resident slots: their tensors as raw bytes in one file.

Spill data used to be `torch.save` / `torch.load(weights_only=True)` of the whole `AdapterState`: every
factor, gradient and AdamW moment pickled and unpickled one by one. With many more active tenants than
slots (bench/load.py, N = 128 on 16 slots) nearly every step spills and restores an adapter twice, and
that pickling was ~85 % of the scheduler thread in py-spy: ~30 ms per spill + restore of a 190 KB adapter.
Then the tensors of each dtype went into a file of their own per spill, back to back. At 512 tenants that
left the file system and per-tensor Python as the cost (py-spy of the loop thread: creating the file 11 %,
a view, a `reshape` and a layout entry per tensor another 15 %; ~120 tensors an adapter):

* One file per `SpillStore`, an anonymous temporary file in the spill directory (`tempfile.TemporaryFile`:
  no name, gone with the process, so there is nothing to plant in its place and nothing left behind by a
  crash). An adapter takes a slot of its size, written with one `pwritev` and read back with one
  `preadv`; a restored or dropped adapter's slot is reused. No file is created, opened or deleted per spill.
* The layout (which tensor, its shape and offset) stays in memory, built once per kind of adapter: looked
  up by what determines it (the bank the adapter sits in, its tensor names), not rebuilt and hashed per spill.
  Tensors are flattened and cut back by one C++ call each (`_flatten_dense_tensors` and its inverse).

The bytes are only ever read as numbers, never interpreted, and a slot that cannot be read back whole (a
truncated file) is refused (`SpillFileCorrupt`).
"""

from __future__ import annotations

import os
import tempfile
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from worker.engine.adapters import AdapterState

_ALIGN = 64
"""Each run of tensors starts at a multiple of this in a slot, so every dtype's view of the bytes is aligned."""

_MOMENTS = ("exp_avg", "exp_avg_sq")


class SpillFileCorrupt(RuntimeError):
    """A spilled adapter whose bytes cannot be read back whole: it is refused, not read."""


@dataclass(frozen=True)
class _Slice:
    """One tensor of a run: what it is and its shape."""

    group: str
    """"param", "grad", or an optimizer moment name ("exp_avg", "exp_avg_sq")."""
    key: str
    shape: tuple[int, ...]
    numel: int


@dataclass(frozen=True, eq=False)
class _Run:
    """Tensors of one dtype stored back to back from `offset` (flattened by one call, cut back by one)."""

    dtype: torch.dtype
    offset: int
    slices: tuple[_Slice, ...]
    positions: tuple[int, ...]
    """Where each slice's tensor is in `_tensors(state)`'s order."""
    templates: tuple[torch.Tensor, ...] = field(repr=False)
    """Empty meta tensors of the slices' shapes: what the inverse of the flattening cuts the run back to."""

    @property
    def nbytes(self) -> int:
        return sum(s.numel for s in self.slices) * self.dtype.itemsize


@dataclass(frozen=True, eq=False)
class SpillLayout:
    """Where each tensor of one kind of adapter is in its slot; shared by every adapter of that kind."""

    runs: tuple[_Run, ...]
    size: int


@dataclass(frozen=True)
class SpillRecord:
    """A spilled adapter: its state without tensors, and where in the store its tensors are."""

    state: AdapterState
    offset: int
    layout: SpillLayout

    @property
    def size(self) -> int:
        return self.layout.size


class SpillStore:
    """Slots of one anonymous file under `directory` (the system's temporary directory when None), opened on
    the first write; thread-compatible like `AdapterSlots` (the engine's lock serialises every call)."""

    def __init__(self, directory: Path | None) -> None:
        self._directory = directory
        self._file: IO[bytes] | None = None
        self._end = 0
        self._free: dict[int, list[int]] = {}
        """Slot size -> offsets of free slots of that size."""
        self._layouts: dict[tuple[object, ...], SpillLayout] = {}
        self.layouts_built = 0
        """How many layouts were built (once per kind of adapter): for tests."""

    def write(self, state: AdapterState) -> SpillRecord:
        """Write `state`'s factors, pending gradients and moments to a free slot. Raises `OSError` (disk full,
        unwritable directory) with nothing kept. The caller then frees the tensors; the record brings them
        back."""
        tensors = _tensors(state)
        layout = self._layout(state, tensors)
        buffers: list[memoryview | bytes] = []
        with torch.no_grad():
            for run in layout.runs:
                flat = _flatten_dense_tensors([tensors[i][2] for i in run.positions]).to("cpu")
                buffers.append(memoryview(flat.view(torch.uint8).numpy()))
                buffers.append(bytes(_padded(run.nbytes) - run.nbytes))
        fd = self._fileno()
        offset = self._allocate(layout.size)
        try:
            _write_all(fd, buffers, offset)
        except OSError:
            self._release(offset, layout.size)
            raise
        return SpillRecord(state, offset, layout)

    def read(self, record: SpillRecord, device: torch.device) -> AdapterState:
        """The adapter of `record` with its tensors back (on `device`), bit for bit as written. Its tensors
        view one fresh buffer (placing the adapter in a bank copies them into its rows)."""
        data = bytearray(record.size)
        read = _read_all(self._fileno(), data, record.offset)
        if read != record.size:
            raise SpillFileCorrupt(f"spilled adapter {record.state.adapter_id!r}: {read} of {record.size} bytes "
                                   "could be read back")
        raw = torch.frombuffer(data, dtype=torch.uint8)
        state = record.state
        grads: dict[str, torch.Tensor] = {}
        for run in record.layout.runs:
            flat = raw[run.offset:run.offset + run.nbytes].view(run.dtype)
            if device.type != "cpu":
                flat = flat.to(device)
            for piece, tensor in zip(run.slices, _unflatten_dense_tensors(flat, run.templates), strict=True):
                if piece.group == "param":
                    state.params[piece.key] = nn.Parameter(tensor, requires_grad=True)
                elif piece.group == "grad":
                    grads[piece.key] = tensor
                else:
                    getattr(state.optimizer, piece.group)[piece.key] = tensor
        for key, tensor in grads.items():
            state.params[key].grad = tensor
        return state

    def free(self, record: SpillRecord) -> None:
        """The slot of a restored or dropped adapter is free for the next spill of that size."""
        self._release(record.offset, record.size)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _fileno(self) -> int:
        if self._file is None:
            directory = self._directory
            if directory is not None:
                directory.mkdir(parents=True, exist_ok=True)
            # Held open for the store's life: one file, no names. Closed (and so gone) by `close()`, or when
            # the store is collected.
            self._file = tempfile.TemporaryFile(dir=directory, prefix="carpool-spill-")  # noqa: SIM115
            weakref.finalize(self, self._file.close)
        return self._file.fileno()

    def _allocate(self, size: int) -> int:
        free = self._free.get(size)
        if free:
            return free.pop()
        offset, self._end = self._end, self._end + size
        return offset

    def _release(self, offset: int, size: int) -> None:
        self._free.setdefault(size, []).append(offset)

    def _layout(self, state: AdapterState, tensors: list[tuple[str, str, torch.Tensor]]) -> SpillLayout:
        signature = _signature(state, tensors)
        layout = self._layouts.get(signature)
        if layout is None:
            layout = self._layouts[signature] = _build_layout(tensors)
            self.layouts_built += 1
        return layout


def _signature(state: AdapterState, tensors: list[tuple[str, str, torch.Tensor]]) -> tuple[object, ...]:
    """What determines an adapter's layout. A banked adapter's tensors are rows of its bank (one dtype, the
    bank's shapes), so its bank and tensor names do; for any other, the names, shapes and dtypes."""
    placement = state.placement
    if placement is not None:
        return (placement.bank, tuple(state.params), tuple(state.grads()),
                *(tuple(getattr(state.optimizer, group)) for group in _MOMENTS))
    return (None, *((group, key, tuple(t.shape), t.dtype) for group, key, t in tensors))


def _build_layout(tensors: list[tuple[str, str, torch.Tensor]]) -> SpillLayout:
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, _, tensor) in enumerate(tensors):
        by_dtype.setdefault(tensor.dtype, []).append(i)
    runs, offset = [], 0
    for dtype, positions in by_dtype.items():
        slices = tuple(_Slice(tensors[i][0], tensors[i][1], tuple(tensors[i][2].shape), tensors[i][2].numel())
                       for i in positions)
        templates = tuple(torch.empty(s.shape, dtype=dtype, device="meta") for s in slices)
        run = _Run(dtype, offset, slices, tuple(positions), templates)
        runs.append(run)
        offset += _padded(run.nbytes)
    return SpillLayout(tuple(runs), offset)


def _padded(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _write_all(fd: int, buffers: list[memoryview | bytes], offset: int) -> None:
    """`pwritev` until every byte is written (a write may be short)."""
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    while views:
        written = os.pwritev(fd, views, offset)
        offset += written
        while views and written >= len(views[0]):
            written -= len(views[0])
            views.pop(0)
        if views and written:
            views[0] = views[0][written:]


def _read_all(fd: int, data: bytearray, offset: int) -> int:
    """`preadv` into `data` until it is full or the file ends; the bytes read."""
    view, done = memoryview(data), 0
    while done < len(data):
        read = os.preadv(fd, [view[done:]], offset + done)
        if read == 0:
            break
        done += read
    return done


def strip_tensors(state: AdapterState) -> None:
    """Drop a spilled adapter's tensors (they are in its slot) and the views cached on them."""
    state.params.clear()
    for group in _MOMENTS:
        getattr(state.optimizer, group).clear()
    state._weights.clear()
    state._grad_views = None


def _tensors(state: AdapterState) -> list[tuple[str, str, torch.Tensor]]:
    """Factors, accumulated gradients (bank rows while placed, else `.grad`) and moments, by name."""
    grads = state.grads()
    out: list[tuple[str, str, torch.Tensor]] = []
    for key, p in state.params.items():
        out.append(("param", key, p.detach()))
        if key in grads:
            out.append(("grad", key, grads[key]))
    for group in _MOMENTS:
        out.extend((group, key, t) for key, t in getattr(state.optimizer, group).items())
    return out
