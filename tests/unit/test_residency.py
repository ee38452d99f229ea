"""Adapter residency (`worker.engine.residency.AdapterSlots`): spilling never changes training.

Acceptance: four adapters trained round-robin on an engine that keeps only two resident (so the LRU
spills and restores them, one of them between its forward_backward and its optim_step, i.e. with
pending gradients) end bit-for-bit where the same schedule ends with everything resident; an adapter
that gets no requests does not change at all. The host-memory spill path (GPU workers) is checked on
`AdapterSlots` directly.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec
from worker.engine.adapters import AdapterState, OptimizerState
from worker.engine.engine import Engine, EngineConfig
from worker.engine.residency import AdapterSlots, UnknownAdapter

HP = AdamParams(learning_rate=1e-2, weight_decay=0.01, grad_clip_norm=1.0)
SPECS = {
    AdapterId("a0"): LoraSpec(rank=2, seed=1),
    AdapterId("a1"): LoraSpec(rank=4, seed=2, train_mlp=False),
    AdapterId("a2"): LoraSpec(rank=3, seed=3, train_unembed=False),
    AdapterId("a3"): LoraSpec(rank=4, seed=4, train_attn=False),
}
IDLE = AdapterId("idle")

Snapshot = dict[str, torch.Tensor]


def _data(seed: int) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (6, 9):
        seq = rng.integers(0, 512, n + 1)
        data.append(Datum(seq[:-1].astype(np.int64), {"target_tokens": seq[1:].astype(np.int64)}))
    return data


def _work(aid: AdapterId, seed: int) -> ForwardBackwardWork:
    return ForwardBackwardWork(aid, _data(seed))


def _snapshot(engine: Engine, aid: AdapterId) -> Snapshot:
    """Factors, pending gradients and AdamW moments of one adapter, copied."""
    state = engine.adapter(aid)
    out = {f"param:{k}": p.detach().clone() for k, p in state.params.items()}
    out.update({f"grad:{k}": g.clone() for k, g in state.grads().items()})
    out.update({f"exp_avg:{k}": t.clone() for k, t in state.optimizer.exp_avg.items()})
    out.update({f"exp_avg_sq:{k}": t.clone() for k, t in state.optimizer.exp_avg_sq.items()})
    return out


def _schedule(engine: Engine) -> tuple[dict[AdapterId, Snapshot], list[list[AdapterId]]]:
    """Round-robin training; returns final snapshots and who was resident before each optim round."""
    for aid, spec in SPECS.items():
        engine.create_adapter(aid, spec)
    engine.create_adapter(IDLE, LoraSpec(rank=2, seed=5))
    ids = list(SPECS)
    resident_at_optim: list[list[AdapterId]] = []
    for rnd in range(2):
        for k, aid in enumerate(ids):  # one adapter per pass: each evicts the least recently used
            engine.forward_backward([_work(aid, 10 * rnd + k)])
        resident_at_optim.append(engine.slots.resident_ids())
        for aid in ids:
            engine.optim_step(aid, HP)
        # A packed pass over three adapters (over the cap: the pass pins them all), then accumulation.
        engine.forward_backward([_work(ids[0], 100 + rnd), _work(ids[2], 101), _work(ids[3], 102)])
        engine.forward_backward([_work(ids[1], 103)])
        engine.forward_backward([_work(ids[0], 104), _work(ids[1], 105)])
        resident_at_optim.append(engine.slots.resident_ids())
        for aid in reversed(ids):
            engine.optim_step(aid, HP)
    return {aid: _snapshot(engine, aid) for aid in [*ids, IDLE]}, resident_at_optim


def _assert_same(a: Snapshot, b: Snapshot) -> None:
    assert a.keys() == b.keys()
    for key, t in a.items():
        assert torch.equal(t, b[key]), key


def test_spilling_does_not_change_training(tiny_model_dir: Path, tmp_path: Path) -> None:
    def engine(cap: int) -> Engine:
        config = EngineConfig(device="cpu", dtype="float32", max_resident_adapters=cap, spill_dir=tmp_path)
        return Engine(tiny_model_dir, name="tiny", config=config)

    small, big = engine(2), engine(64)
    got, resident = _schedule(small)
    want, _ = _schedule(big)
    assert small.slots.spills > 0 and small.slots.restores > 0
    assert big.slots.spills == 0
    # a0 had pending gradients when later passes pushed it out of the two slots.
    assert AdapterId("a0") not in resident[0]
    for aid in want:
        _assert_same(got[aid], want[aid])


def test_adapter_without_requests_does_not_change(tiny_model_dir: Path, tmp_path: Path) -> None:
    config = EngineConfig(device="cpu", dtype="float32", max_resident_adapters=2, spill_dir=tmp_path)
    engine = Engine(tiny_model_dir, name="tiny", config=config)
    engine.create_adapter(IDLE, LoraSpec(rank=2, seed=5))
    before = _snapshot(engine, IDLE)
    for aid, spec in SPECS.items():
        engine.create_adapter(aid, spec)
    for rnd in range(2):
        engine.forward_backward([_work(aid, rnd) for aid in SPECS])
        for aid in SPECS:
            engine.optim_step(aid, HP)
    assert IDLE not in engine.slots.resident_ids()  # it was spilled ...
    _assert_same(_snapshot(engine, IDLE), before)  # ... and comes back exactly as it was
    assert not any(k.startswith(("grad:", "exp_avg")) for k in before)


# -- AdapterSlots alone: both spill targets ------------------------------------------------------------
def _state(aid: str, seed: int) -> AdapterState:
    gen = torch.Generator().manual_seed(seed)
    params = {f"l.{f}": torch.nn.Parameter(torch.randn(3, 5, generator=gen)) for f in ("lora_A", "lora_B")}
    for p in params.values():
        p.grad = torch.randn(p.shape, generator=gen)
    opt = OptimizerState(step=seed, exp_avg={k: torch.randn(3, 5, generator=gen) for k in params},
                         exp_avg_sq={k: torch.rand(3, 5, generator=gen) for k in params})
    return AdapterState(AdapterId(aid), LoraSpec(rank=3, seed=seed), seed, params, opt,
                        pending_grad_passes=seed % 3)


def _raw(state: AdapterState) -> Snapshot:
    out = {f"param:{k}": p.detach().clone() for k, p in state.params.items()}
    grads = state.grads()
    assert set(grads) == set(state.params)
    out.update({f"grad:{k}": g.clone() for k, g in grads.items()})
    out.update({f"m:{k}": t.clone() for k, t in state.optimizer.exp_avg.items()})
    out.update({f"v:{k}": t.clone() for k, t in state.optimizer.exp_avg_sq.items()})
    return out


@pytest.mark.parametrize("to_disk", [True, False], ids=["disk", "host"])
def test_slots_spill_and_restore_exactly(tmp_path: Path, to_disk: bool) -> None:
    slots = AdapterSlots(torch.device("cpu"), max_resident=1, spill_dir=tmp_path)
    slots._spill_to_disk = to_disk  # the host path is what GPU workers take; force it to cover it here
    states = [_state(f"s{i}", i + 1) for i in range(3)]
    expected = {s.adapter_id: (_raw(s), s.optimizer.step, s.pending_grad_passes, s.spec) for s in states}
    for s in states:
        slots.put(s)
    assert slots.resident_ids() == [AdapterId("s2")] and slots.spills == 2
    for aid in [AdapterId("s0"), AdapterId("s1"), AdapterId("s0"), AdapterId("s2")]:
        state = slots.get(aid)
        raw, step, pending, spec = expected[aid]
        _assert_same(_raw(state), raw)
        assert (state.optimizer.step, state.pending_grad_passes, state.spec) == (step, pending, spec)
        assert all(p.requires_grad and p.is_leaf for p in state.params.values())
    assert slots.restores == 4 and len(slots) == 3
    slots.drop(AdapterId("s0"))
    with pytest.raises(UnknownAdapter):
        slots.get(AdapterId("s0"))
    if not to_disk:
        assert not any(tmp_path.iterdir())  # host spills never touch the disk


def test_pinned_adapters_are_never_evicted(tmp_path: Path) -> None:
    slots = AdapterSlots(torch.device("cpu"), max_resident=1, spill_dir=tmp_path)
    for i in range(3):
        slots.put(_state(f"s{i}", i + 1))
    pinned = {AdapterId("s0"), AdapterId("s1"), AdapterId("s2")}
    for aid in sorted(pinned):
        slots.get(aid, pinned=pinned)
    assert sorted(slots.resident_ids()) == sorted(pinned)  # over the cap rather than thrash a pass


def test_disk_spill_keeps_ids_with_the_same_safe_name_apart(tmp_path: Path) -> None:
    slots = AdapterSlots(torch.device("cpu"), max_resident=1, spill_dir=tmp_path)
    first, second = _state("run/1", 1), _state("run_1", 2)
    want = _raw(first)
    slots.put(first)
    slots.put(second)
    slots.put(_state("other", 3))  # spills run_1 onto run/1's file
    _assert_same(_raw(slots.get(AdapterId("run/1"))), want)


def test_a_disk_spill_is_raw_bytes_and_leaves_no_tensors_in_memory(tmp_path: Path) -> None:
    slots = AdapterSlots(torch.device("cpu"), max_resident=1, spill_dir=tmp_path)
    slots._spill_to_disk = True
    state = _state("s0", 1)
    want = _raw(state)
    slots.put(state)
    slots.put(_state("s1", 2))  # spills s0
    # One anonymous file for every spilled adapter: nothing in the directory to find or to plant a file as.
    assert list(tmp_path.iterdir()) == []
    record = slots._on_disk[AdapterId("s0")]
    floats = sum(t.numel() for t in want.values())
    assert record.size == -(-floats * 4 // 64) * 64
    store_file = slots._store._file
    assert store_file is not None
    data = os.pread(store_file.fileno(), record.size, record.offset)
    # Numbers only (not a pickle or a torch zip): every factor, gradient and moment of s0, which now holds
    # none of them in memory.
    assert len(data) == record.size and not data.startswith((b"PK", b"\x80"))
    assert state.params == {} and state.optimizer.exp_avg == {} and state.optimizer.exp_avg_sq == {}
    assert not state._weights and state._grad_views is None
    _assert_same(_raw(slots.get(AdapterId("s0"))), want)  # and s1 spills, into the slot s0 left
    assert slots._on_disk[AdapterId("s1")].offset == record.offset


def test_spills_and_restores_open_no_files_and_build_one_layout_per_kind(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # With tenants far beyond the slots every step spills and restores: a file created, opened and deleted
    # for each of those, and a layout built and hashed per spill, were most of a swap's cost at 512 tenants.
    slots = AdapterSlots(torch.device("cpu"), max_resident=2, spill_dir=tmp_path)
    states = {AdapterId(f"s{i}"): _state(f"s{i}", i + 1) for i in range(6)}
    want = {aid: _raw(state) for aid, state in states.items()}
    for state in states.values():
        slots.put(state)
    opened: list[object] = []
    real_open = Path.open

    def counting_open(self: Path, *args: object, **kwargs: object) -> object:
        opened.append(self)
        return real_open(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Path, "open", counting_open)
    for _ in range(3):
        for aid in states:
            _assert_same(_raw(slots.get(aid)), want[aid])
    assert slots.spills >= 18 and slots.restores >= 18
    assert opened == [] and list(tmp_path.iterdir()) == []
    assert slots._store.layouts_built == 1  # every adapter here is of one kind


def test_a_banked_adapter_spills_with_its_pending_gradient(tiny_model_dir: Path, tmp_path: Path) -> None:
    # Spills are written straight from the bank rows (no private copies first): the gradient a pass left
    # in an adapter's gradient rows must be in the file, and must not be clobbered by the row's next owner.
    config = EngineConfig(device="cpu", dtype="float32", max_resident_adapters=1, spill_dir=tmp_path)
    engine = Engine(tiny_model_dir, name="tiny", config=config)
    first, second = AdapterId("a0"), AdapterId("a1")
    engine.create_adapter(first, SPECS[first])
    engine.forward_backward([_work(first, 1)])
    before = _snapshot(engine, first)
    assert any(k.startswith("grad:") for k in before)
    engine.create_adapter(second, LoraSpec(rank=2, seed=9))  # a0's shapes, same bank: a0 spills
    third = AdapterId("a2")
    engine.create_adapter(third, LoraSpec(rank=2, seed=10))  # placed in the row a0 left; a1 spills
    engine.forward_backward([_work(third, 2)])  # and trains there
    assert engine.slots.resident_ids() == [third]
    _assert_same(_snapshot(engine, first), before)


def test_a_failed_disk_spill_keeps_the_adapter_in_memory(tmp_path: Path) -> None:
    blocked = tmp_path / "spill"
    blocked.write_text("a file where the spill directory should be")
    slots = AdapterSlots(torch.device("cpu"), max_resident=1, spill_dir=blocked)
    slots._spill_to_disk = True
    state = _state("s0", 1)
    want = _raw(state)
    slots.put(state)
    slots.put(_state("s1", 2))  # the spill of s0 fails: it stays in host memory
    assert slots.resident_ids() == [AdapterId("s1")] and len(slots) == 2
    _assert_same(_raw(slots.get(AdapterId("s0"))), want)
