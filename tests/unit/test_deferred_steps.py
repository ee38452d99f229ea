"""Deferred optimizer steps: `optim_step` prepares, the next engine call applies, tenants together.

Steps applied together (one update call over consecutive bank rows) must end exactly where each applied
at once ends; no engine entry point may see or move an adapter with a step still pending; an adapter's
second step applies its first; a pending step survives its adapter (or another) being spilled.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from services.domain.sampling import SampleWork
from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec
from worker.engine.engine import Engine, EngineConfig

IDS = [AdapterId(f"t{i}") for i in range(4)]
HP = AdamParams(learning_rate=5e-3, weight_decay=0.01)


def _engine(model_dir: Path, max_resident: int = 64) -> Engine:
    engine = Engine(model_dir, name="t", config=EngineConfig(device="cpu", dtype="float32",
                                                             max_resident_adapters=max_resident))
    for i, aid in enumerate(IDS):
        engine.create_adapter(aid, LoraSpec(rank=8, seed=i))
    return engine


def _work(aid: AdapterId, seed: int) -> ForwardBackwardWork:
    seq = np.random.default_rng(seed).integers(0, 512, 13)
    return ForwardBackwardWork(aid, [Datum(seq[:-1], {"target_tokens": seq[1:]})])


def _state(engine: Engine, aid: AdapterId) -> dict[str, torch.Tensor]:
    state = engine.adapter(aid)
    out = {f"p:{k}": p.detach().clone() for k, p in state.params.items()}
    out.update({f"m:{k}": t.clone() for k, t in state.optimizer.exp_avg.items()})
    out.update({f"v:{k}": t.clone() for k, t in state.optimizer.exp_avg_sq.items()})
    return out


def _train(engine: Engine, steps: int, *, each_at_once: bool, clip_some: bool = False) -> None:
    for step in range(steps):
        engine.forward_backward([_work(aid, 10 * step + i) for i, aid in enumerate(IDS)])
        for i, aid in enumerate(IDS):
            clip = 0.05 if clip_some and i % 2 else 0.0  # clipped tenants still share the update call
            engine.optim_step(aid, AdamParams(**{**HP.__dict__, "grad_clip_norm": clip}))
            if each_at_once:
                engine.apply_pending_steps()


@pytest.mark.parametrize("clip_some", [False, True])
def test_steps_applied_together_equal_steps_applied_at_once(tiny_model_dir: Path, clip_some: bool) -> None:
    together, at_once = _engine(tiny_model_dir), _engine(tiny_model_dir)
    _train(together, 4, each_at_once=False, clip_some=clip_some)
    _train(at_once, 4, each_at_once=True, clip_some=clip_some)
    for aid in IDS:
        ours, expected = _state(together, aid), _state(at_once, aid)
        assert ours.keys() == expected.keys() and any(k.startswith("m:") for k in ours)
        for key, value in expected.items():
            assert torch.equal(ours[key], value), f"{aid} {key}"
        assert together.adapter(aid).optimizer.step == 4
    # Four tenants' steps went through one update call per round instead of four.
    assert together.steps.batched_calls == 4 and at_once.steps.batched_calls == 16


ENTRY_POINTS: dict[str, Callable[[Engine, Path], object]] = {
    "forward_backward": lambda e, _: e.forward_backward([_work(IDS[1], 99)]),
    "sample": lambda e, _: e.sample([SampleWork(IDS[1], np.arange(4, dtype=np.int64))]),
    "save_adapter": lambda e, tmp: e.save_adapter(IDS[1], tmp / "ckpt", with_optimizer=True),
    "load_adapter": lambda e, tmp: (e.save_adapter(IDS[1], tmp / "c", with_optimizer=False),
                                    e.load_adapter(AdapterId("new"), tmp / "c", with_optimizer=False)),
    "create_adapter": lambda e, _: e.create_adapter(AdapterId("new"), LoraSpec(rank=4, seed=9)),
    "drop_adapter": lambda e, _: e.drop_adapter(IDS[1]),
    "adapter": lambda e, _: e.adapter(IDS[1]),
}


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_every_entry_point_applies_pending_steps_first(tiny_model_dir: Path, tmp_path: Path, entry: str) -> None:
    engine, reference = _engine(tiny_model_dir), _engine(tiny_model_dir)
    for e in (engine, reference):
        e.forward_backward([_work(aid, i) for i, aid in enumerate(IDS)])
        for aid in IDS:
            e.optim_step(aid, HP)
    assert len(engine.steps) == len(IDS)
    reference.apply_pending_steps()
    ENTRY_POINTS[entry](engine, tmp_path)
    assert len(engine.steps) == 0
    for key, value in _state(reference, IDS[0]).items():
        assert torch.equal(_state(engine, IDS[0])[key], value), key


def test_second_step_without_a_pass_applies_the_first_and_changes_nothing_more(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir)
    engine.forward_backward([_work(IDS[0], 1)])
    engine.optim_step(IDS[0], HP)
    after_first = _state(engine, IDS[0])
    engine.optim_step(IDS[0], HP)  # no gradient since: a no-op step
    assert len(engine.steps) == 0 and engine.adapter(IDS[0]).optimizer.step == 1
    for key, value in after_first.items():
        assert torch.equal(_state(engine, IDS[0])[key], value), key


def test_pending_step_survives_spilling(tiny_model_dir: Path) -> None:
    """Two slots, four tenants: stepping a spilled tenant brings it back, pushing out one with a pending step."""
    engine, reference = _engine(tiny_model_dir, max_resident=2), _engine(tiny_model_dir)
    for e in (engine, reference):
        for i, aid in enumerate(IDS):
            e.forward_backward([_work(aid, i)])
            e.optim_step(aid, HP)
    reference.apply_pending_steps()
    for aid in IDS:
        for key, value in _state(reference, aid).items():
            assert torch.equal(_state(engine, aid)[key], value), f"{aid} {key}"
    assert engine.slots.spills > 0


def test_stepping_a_spilled_tenant_applies_pending_steps_before_it_evicts_their_owner(tiny_model_dir: Path) -> None:
    engine, reference = _engine(tiny_model_dir, max_resident=2), _engine(tiny_model_dir)
    for e in (engine, reference):
        e.forward_backward([_work(IDS[2], 1), _work(IDS[3], 2)])
        e.optim_step(IDS[2], HP)
        e.optim_step(IDS[3], HP)  # both pending; t2 is now the least recently used
    assert engine.slots.resident_ids() == [IDS[2], IDS[3]] and len(engine.steps) == 2
    # t0 comes back from disk and t2 goes there (a clipped step needs its adapter back; an unclipped one
    # would be parked with the spilled adapter instead).
    engine.optim_step(IDS[0], AdamParams(learning_rate=5e-3, grad_clip_norm=1.0))
    assert IDS[2] not in engine.slots.resident_ids()
    reference.apply_pending_steps()
    for aid in (IDS[2], IDS[3]):
        for key, value in _state(reference, aid).items():
            assert torch.equal(_state(engine, aid)[key], value), f"{aid} {key}"


def test_tenants_in_scattered_rows_step_in_one_update_call(tiny_model_dir: Path) -> None:
    """t2 does not step: t0 and t1 (a run of rows) and t3 share one update call, equal to stepping at once."""
    together, at_once = _engine(tiny_model_dir), _engine(tiny_model_dir)
    stepping = [IDS[0], IDS[1], IDS[3]]
    for engine, each_at_once in ((together, False), (at_once, True)):
        engine.forward_backward([_work(aid, i) for i, aid in enumerate(IDS)])
        for aid in stepping:
            engine.optim_step(aid, HP)
            if each_at_once:
                engine.apply_pending_steps()
        engine.apply_pending_steps()
    assert together.steps.batched_calls == 1 and at_once.steps.batched_calls == 3
    for aid in IDS:
        for key, value in _state(at_once, aid).items():
            assert torch.equal(_state(together, aid)[key], value), f"{aid} {key}"
    assert together.adapter(IDS[2]).grads() and together.adapter(IDS[2]).optimizer.step == 0


def test_tenants_at_different_step_counts_share_one_update_call(tiny_model_dir: Path) -> None:
    """t0 and t2 took a step before the others: four step counts over two, one call, equal to at once."""
    together, at_once = _engine(tiny_model_dir), _engine(tiny_model_dir)
    for engine, each_at_once in ((together, False), (at_once, True)):
        ahead = [IDS[0], IDS[2]]
        engine.forward_backward([_work(aid, 50 + i) for i, aid in enumerate(ahead)])
        for aid in ahead:
            engine.optim_step(aid, HP)
        engine.apply_pending_steps()
        calls = engine.steps.batched_calls
        _train(engine, 2, each_at_once=each_at_once)
        engine.apply_pending_steps()
        if not each_at_once:
            assert engine.steps.batched_calls - calls == 2  # one per round, whatever the step counts
    assert [together.adapter(aid).optimizer.step for aid in IDS] == [3, 2, 3, 2]
    for aid in IDS:
        for key, value in _state(at_once, aid).items():
            assert torch.equal(_state(together, aid)[key], value), f"{aid} {key}"


def test_tenants_with_other_hyper_parameters_get_their_own_call(tiny_model_dir: Path) -> None:
    together, at_once = _engine(tiny_model_dir), _engine(tiny_model_dir)
    for engine, each_at_once in ((together, False), (at_once, True)):
        engine.forward_backward([_work(aid, i) for i, aid in enumerate(IDS)])
        for i, aid in enumerate(IDS):
            engine.optim_step(aid, HP if i % 2 else AdamParams(learning_rate=1e-3))
            if each_at_once:
                engine.apply_pending_steps()
        engine.apply_pending_steps()
    assert together.steps.batched_calls == 2
    for aid in IDS:
        for key, value in _state(at_once, aid).items():
            assert torch.equal(_state(together, aid)[key], value), f"{aid} {key}"


# -- steps of spilled adapters: parked with the adapter, applied when it comes back --------------------------


def _passes_then_steps(engine: Engine, rounds: int, hp: AdamParams = HP) -> None:
    """bench/load.py's pattern with more tenants than slots: every tenant's pass, then every tenant's step
    (by the time a tenant's step arrives, later passes evicted its adapter)."""
    for r in range(rounds):
        for i, aid in enumerate(IDS):
            engine.forward_backward([_work(aid, 10 * r + i)])
        for aid in IDS:
            engine.optim_step(aid, hp)


def test_a_spilled_adapters_step_waits_for_it_and_ends_where_stepping_at_once_ends(tiny_model_dir: Path) -> None:
    """One slot, four tenants: a step no longer brings its adapter back just to update it (half the reloads),
    and every tenant ends bit-for-bit where stepping each at once, all resident, ends."""
    engine, reference = _engine(tiny_model_dir, max_resident=1), _engine(tiny_model_dir)
    _passes_then_steps(engine, 3)
    _passes_then_steps(reference, 3)
    reference.apply_pending_steps()
    reloads = engine.slots.restores
    assert reloads <= 3 * len(IDS)  # one per pass (the steps of spilled tenants reload nothing)
    for aid in IDS:
        for key, value in _state(reference, aid).items():
            assert torch.equal(_state(engine, aid)[key], value), f"{aid} {key}"
        assert engine.adapter(aid).optimizer.step == 3


def test_a_parked_step_is_applied_before_any_entry_point_reads_the_adapter(tiny_model_dir: Path,
                                                                            tmp_path: Path) -> None:
    """Saving (or sampling, or a second step) a tenant whose step is parked sees the step applied."""
    engine, reference = _engine(tiny_model_dir, max_resident=1), _engine(tiny_model_dir)
    for e in (engine, reference):
        e.forward_backward([_work(IDS[0], 1)])
        e.forward_backward([_work(IDS[1], 2)])  # evicts t0 (one slot)
        e.optim_step(IDS[0], HP)
    reference.apply_pending_steps()
    assert IDS[0] not in engine.slots.resident_ids()
    engine.optim_step(IDS[0], HP)  # a second step: the first is applied, no gradient is left for this one
    engine.save_adapter(IDS[0], tmp_path / "ckpt", with_optimizer=True)
    assert engine.adapter(IDS[0]).optimizer.step == 1
    for key, value in _state(reference, IDS[0]).items():
        assert torch.equal(_state(engine, IDS[0])[key], value), key


def test_a_clipped_step_of_a_spilled_adapter_still_runs_at_once(tiny_model_dir: Path) -> None:
    """Clipping needs the gradient's norm, which the caller gets back: the adapter comes back for it."""
    engine = _engine(tiny_model_dir, max_resident=1)
    engine.forward_backward([_work(IDS[0], 1)])
    engine.forward_backward([_work(IDS[1], 2)])
    reloads = engine.slots.restores
    result = engine.optim_step(IDS[0], AdamParams(learning_rate=5e-3, grad_clip_norm=0.5))
    assert "grad_norm:mean" in result.metrics and engine.slots.restores == reloads + 1


def test_dropping_a_spilled_adapter_drops_its_parked_step(tiny_model_dir: Path) -> None:
    engine = _engine(tiny_model_dir, max_resident=1)
    engine.forward_backward([_work(IDS[0], 1)])
    engine.forward_backward([_work(IDS[1], 2)])
    engine.optim_step(IDS[0], HP)
    engine.drop_adapter(IDS[0])
    engine.create_adapter(IDS[0], LoraSpec(rank=8, seed=0))  # a new adapter under the old id: no old step
    assert engine.adapter(IDS[0]).optimizer.step == 0
