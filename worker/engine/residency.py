"""Adapter slots: which adapters are resident on the compute device, with an LRU that spills the rest.

Adapters stay resident between calls (never swapped per request). Beyond `max_resident`, the least
recently used adapter not pinned by the pass in flight moves, with its gradients and optimizer
state, to host memory (GPU workers) or to a spill directory (CPU workers, where host memory *is*
the device), and comes back on demand bit-for-bit.

Spill files hold raw tensor bytes. They used to be `torch.save` / `torch.load(weights_only=True)` of the
whole `AdapterState`: every factor, gradient and AdamW moment pickled and unpickled one by one. With many
more active tenants than slots (bench/load.py, N = 128 on 16 slots) nearly every step spills and restores
an adapter twice, and that pickling was ~85 % of the scheduler thread in py-spy: ~30 ms per spill +
restore of a 190 KB adapter, whose bytes take well under a millisecond to write and read. Now the tensors
of each dtype go into the file back to back (one `cat`, written straight from the bank rows), and the
layout (which tensor, shape, offset) stays in memory with the rest of the state (spec, seed, step count),
one layout shared by all adapters of a shape: ~2 KB per spilled adapter. The file is only ever read as
numbers, never interpreted: a planted file cannot run code, and one of the wrong size is refused
(`SpillFileCorrupt`) instead of read.
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from services.domain.training import AdapterId
from worker.engine.adapters import AdapterState
from worker.engine.banks import AdapterBanks

log = logging.getLogger(__name__)


class UnknownAdapter(KeyError):
    def __init__(self, adapter_id: str) -> None:
        super().__init__(adapter_id)
        self.adapter_id = adapter_id

    def __str__(self) -> str:
        return f"adapter {self.adapter_id!r} does not exist on this worker (create or load it first)"


class AdapterSlots:
    """Resident adapters in LRU order plus spilled ones; `get` brings an adapter back when needed.

    Resident adapters' factors live in `banks` (stacked rows a grouped pass reads without copying);
    an adapter leaves its row whenever it stops being resident.
    """

    def __init__(self, device: torch.device, max_resident: int, spill_dir: Path | None = None) -> None:
        if max_resident < 1:
            raise ValueError("max_resident must be >= 1")
        self.device = device
        self.max_resident = max_resident
        self._resident: OrderedDict[AdapterId, AdapterState] = OrderedDict()
        self._on_host: dict[AdapterId, AdapterState] = {}
        self._on_disk: dict[AdapterId, SpillRecord] = {}
        self._layouts: dict[tuple[_Run, ...], tuple[_Run, ...]] = {}
        self._spill_to_disk = device.type == "cpu"
        self._spill_dir = spill_dir
        self.banks = AdapterBanks()
        self.spills = 0
        self.restores = 0

    def __contains__(self, adapter_id: object) -> bool:
        return adapter_id in self._resident or adapter_id in self._on_host or adapter_id in self._on_disk

    def __len__(self) -> int:
        return len(self._resident) + len(self._on_host) + len(self._on_disk)

    def ids(self) -> list[AdapterId]:
        return [*self._resident, *self._on_host, *self._on_disk]

    def resident_ids(self) -> list[AdapterId]:
        return list(self._resident)

    def is_resident(self, adapter_id: AdapterId) -> bool:
        return adapter_id in self._resident

    def put(self, state: AdapterState, pinned: Iterable[AdapterId] = ()) -> None:
        self.drop(state.adapter_id)
        self.banks.place(state)
        self._resident[state.adapter_id] = state
        self._evict(set(pinned) | {state.adapter_id})

    def get(self, adapter_id: AdapterId, pinned: Iterable[AdapterId] = ()) -> AdapterState:
        """The adapter, resident on the device; `pinned` adapters (the current pass) are never evicted."""
        state = self._resident.get(adapter_id)
        if state is not None:
            self._resident.move_to_end(adapter_id)
            return state
        state = self._restore(adapter_id)
        self.banks.place(state)
        self._resident[adapter_id] = state
        self._evict(set(pinned) | {adapter_id})
        return state

    def drop(self, adapter_id: AdapterId) -> None:
        state = self._resident.pop(adapter_id, None)
        if state is not None:
            self.banks.release(state)
        self._on_host.pop(adapter_id, None)
        record = self._on_disk.pop(adapter_id, None)
        if record is not None:
            record.path.unlink(missing_ok=True)

    def _evict(self, pinned: set[AdapterId]) -> None:
        while len(self._resident) > self.max_resident:
            victim = next((a for a in self._resident if a not in pinned), None)
            if victim is None:
                return  # everything resident is in use by this pass: exceed the cap rather than thrash
            self._spill(self._resident.pop(victim))

    def _spill(self, state: AdapterState) -> None:
        self.spills += 1
        if not self._spill_to_disk:
            self.banks.release(state)
            state.to("cpu")
            self._on_host[state.adapter_id] = state
            return
        try:
            # Written from where the tensors are (bank rows while placed): no private copies on the way.
            record = write_spill(state, self._spill_path(state.adapter_id), self._layouts)
        except OSError:
            # A full or unwritable disk must not lose the adapter: it stays in host memory instead.
            log.exception("could not spill adapter %s to disk; keeping it in memory", state.adapter_id)
            self.banks.release(state)
            self._on_host[state.adapter_id] = state
            return
        self.banks.vacate(state)
        strip_tensors(state)
        self._on_disk[state.adapter_id] = record
        log.debug("spilled adapter %s to %s", state.adapter_id, record.path)

    def _restore(self, adapter_id: AdapterId) -> AdapterState:
        self.restores += 1
        if adapter_id in self._on_host:
            state = self._on_host.pop(adapter_id)
            state.to(self.device)
            return state
        if adapter_id in self._on_disk:
            record = self._on_disk.pop(adapter_id)
            try:
                return read_spill(record, self.device)
            finally:
                record.path.unlink(missing_ok=True)
        raise UnknownAdapter(adapter_id)

    def _spill_path(self, adapter_id: AdapterId) -> Path:
        if self._spill_dir is None:
            self._spill_dir = Path(tempfile.mkdtemp(prefix="carpool-spill-"))
        self._spill_dir.mkdir(parents=True, exist_ok=True)
        # Sanitised names can collide ("run/1" vs "run_1"): a digest of the real id keeps them apart.
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in adapter_id)[:64]
        digest = hashlib.sha256(adapter_id.encode()).hexdigest()[:16]
        return self._spill_dir / f"{safe}-{digest}.spill"


# -- spill files ---------------------------------------------------------------------------------------
_ALIGN = 64
"""Each run of tensors starts at a multiple of this in the file, so every dtype's view of the bytes is
aligned."""

_MOMENTS = ("exp_avg", "exp_avg_sq")


class SpillFileCorrupt(RuntimeError):
    """A spill file that is not the one this worker wrote (wrong size): it is refused, not read."""


@dataclass(frozen=True)
class _Slice:
    """One tensor of a run: what it is and its shape."""

    group: str
    """"param", "grad", or an optimizer moment name ("exp_avg", "exp_avg_sq")."""
    key: str
    shape: tuple[int, ...]
    numel: int


@dataclass(frozen=True)
class _Run:
    """Tensors of one dtype stored back to back from `offset`: written by one `cat`, read by one copy and
    one `split` (per-tensor copies were most of a spill's cost: an adapter has ~100 small tensors)."""

    dtype: torch.dtype
    offset: int
    slices: tuple[_Slice, ...]

    @property
    def nbytes(self) -> int:
        return sum(s.numel for s in self.slices) * self.dtype.itemsize


@dataclass(frozen=True)
class SpillRecord:
    """A spilled adapter: its state without tensors, the file holding them, and where each one is."""

    state: AdapterState
    path: Path
    runs: tuple[_Run, ...]
    size: int


def write_spill(state: AdapterState, path: Path,
                layouts: dict[tuple[_Run, ...], tuple[_Run, ...]] | None = None) -> SpillRecord:
    """Write `state`'s factors, pending gradients and moments to `path`. The caller then frees them (the
    adapter's bank row, or its private tensors via `strip_tensors`); the record brings them back."""
    by_dtype: dict[torch.dtype, list[tuple[_Slice, torch.Tensor]]] = {}
    for group, key, tensor in _tensors(state):
        by_dtype.setdefault(tensor.dtype, []).append((_Slice(group, key, tuple(tensor.shape), tensor.numel()),
                                                      tensor))
    runs, offset = [], 0
    try:
        with path.open("wb") as f:
            for dtype, pieces in by_dtype.items():
                run = _Run(dtype, offset, tuple(piece for piece, _ in pieces))
                flat = torch.cat([t.detach().reshape(-1) for _, t in pieces]).to("cpu")
                f.write(memoryview(flat.view(torch.uint8).numpy()))
                padded = -(-run.nbytes // _ALIGN) * _ALIGN
                f.write(bytes(padded - run.nbytes))
                runs.append(run)
                offset += padded
    except OSError:
        path.unlink(missing_ok=True)  # no half-written file left behind
        raise
    shared = tuple(runs)
    if layouts is not None:  # adapters of one shape share one layout (~16 KB each otherwise)
        shared = layouts.setdefault(shared, shared)
    return SpillRecord(state, path, shared, offset)


def read_spill(record: SpillRecord, device: torch.device) -> AdapterState:
    """The adapter of `record` with its tensors back on `device`, bit for bit as it was written."""
    data = record.path.read_bytes()
    if len(data) != record.size:
        raise SpillFileCorrupt(f"spill file {record.path} has {len(data)} bytes, {record.size} were written")
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    state = record.state
    grads: dict[str, torch.Tensor] = {}
    for run in record.runs:
        # One copy per run: the tensors are views of storage of their own, not of the file's buffer.
        flat = raw[run.offset:run.offset + run.nbytes].view(run.dtype).to(device, copy=True)
        for piece, tensor in zip(run.slices, flat.split([s.numel for s in run.slices]), strict=True):
            tensor = tensor.view(piece.shape)
            if piece.group == "param":
                state.params[piece.key] = nn.Parameter(tensor, requires_grad=True)
            elif piece.group == "grad":
                grads[piece.key] = tensor
            else:
                getattr(state.optimizer, piece.group)[piece.key] = tensor
    for key, tensor in grads.items():
        state.params[key].grad = tensor
    return state


def strip_tensors(state: AdapterState) -> None:
    """Drop a spilled adapter's tensors (they are in its file) and the views cached on them."""
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
