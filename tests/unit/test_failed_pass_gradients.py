"""A packed call that raises in a later micro-batch leaves no partial gradient behind (issue 16).

The dispatcher re-runs a failed pass's requests one by one; the healthy tenants' gradients and their next
optimizer step must then equal a run in which the failing tenant never took part. The failure is injected
at the pass boundary, in the micro-batch that holds the bad tenant's datum (the second of the call), after
the first micro-batch already accumulated the healthy tenants' gradients.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

import worker.engine.engine as engine_module
from services.domain.training import (
    AdamParams,
    AdapterId,
    Datum,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
    WorkError,
)
from services.runtime.commands import ForwardBackward
from services.runtime.dispatch import Dispatcher
from services.runtime.reporting import LoopCounters
from services.scheduler.requests import PassPlan, PassSegment, PlanItemId, QueuedRequest, RequestId, RequestKind
from worker.engine.engine import Engine, EngineConfig

HEALTHY = (AdapterId("h1"), AdapterId("h2"))
BAD = AdapterId("bad")
HP = AdamParams(learning_rate=1e-2)


def _datum(rng: np.random.Generator, vocab: int, n: int = 10) -> Datum:
    seq = rng.integers(0, vocab, n + 1)
    return Datum(seq[:-1], {"target_tokens": seq[1:], "weights": np.ones(n, np.float32)})


def _engine(model_dir, strategy: str, adapters: tuple[AdapterId, ...]) -> Engine:  # noqa: ANN001
    # 24 tokens per micro-batch: the two healthy 10-token datums share the first, the bad one is second.
    config = EngineConfig(device="cpu", dtype="float32", lora_strategy=strategy, micro_batch_tokens=24)
    engine = Engine(model_dir, name="t", config=config)
    for i, aid in enumerate(adapters):
        engine.create_adapter(aid, LoraSpec(rank=4, seed=10 + i))
    return engine


def _plan(works: list[ForwardBackwardWork]) -> PassPlan:
    segments = tuple(
        PassSegment(w.adapter_id, w.adapter_id, (QueuedRequest(RequestId(f"r-{w.adapter_id}"), w.adapter_id,
                                                               w.adapter_id, RequestKind.FORWARD_BACKWARD, 1,
                                                               sum(d.length for d in w.data),
                                                               payload=ForwardBackward(w)),))
        for w in works
    )
    return PassPlan(PlanItemId(1), segments)


def _fail_on(adapter: AdapterId) -> Callable[..., object]:
    real = engine_module.run_packed_pass

    def run(lm, batch):  # noqa: ANN001, ANN202 - same signature as the real pass
        if any(item.adapter_key == adapter for item in batch):
            raise RuntimeError("injected: out of memory in this micro-batch")
        return real(lm, batch)

    return run


def _grads(engine: Engine, aid: AdapterId) -> dict[str, torch.Tensor]:
    return {k: g.clone() for k, g in engine.adapter(aid).grads().items()}


def _params(engine: Engine, aid: AdapterId) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in engine.adapter(aid).params.items()}


@pytest.mark.parametrize(("strategy", "accumulated"), [("grouped", True), ("loop", False)],
                         ids=["grouped-accumulating", "loop-fresh"])
def test_failed_packed_pass_leaves_only_the_rerun_gradients(tiny_model_dir, monkeypatch: pytest.MonkeyPatch,
                                                            strategy: str, accumulated: bool) -> None:  # noqa: ANN001
    shared = _engine(tiny_model_dir, strategy, (*HEALTHY, BAD))
    alone = _engine(tiny_model_dir, strategy, HEALTHY)
    rng = np.random.default_rng(3)
    vocab = shared.info.vocab_size
    earlier = [ForwardBackwardWork(aid, [_datum(rng, vocab)]) for aid in HEALTHY]
    works = [ForwardBackwardWork(aid, [_datum(rng, vocab)]) for aid in (*HEALTHY, BAD)]
    if accumulated:  # gradients already pending from an earlier call: they must survive the failure as they were
        for engine in (shared, alone):
            engine.forward_backward(earlier)

    monkeypatch.setattr(engine_module, "run_packed_pass", _fail_on(BAD))
    results = Dispatcher(shared, LoopCounters("t"), "t").run(_plan(works))
    monkeypatch.undo()
    assert isinstance(results, list)
    assert [type(r) for r in results] == [ForwardBackwardResult, ForwardBackwardResult, WorkError]
    assert shared.stats.passes >= 3, "the first micro-batch must have run before the failure"
    assert not shared.adapter(BAD).grads() and shared.adapter(BAD).pending_grad_passes == 0
    for work in works[:2]:  # the reference: each healthy request alone, as the re-run runs them
        alone.forward_backward([work])

    for aid in HEALTHY:
        got, want = _grads(shared, aid), _grads(alone, aid)
        assert got.keys() == want.keys() and want
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-7, msg=f"{aid} grad {key}")
        assert shared.adapter(aid).pending_grad_passes == alone.adapter(aid).pending_grad_passes
    for engine in (shared, alone):
        for aid in HEALTHY:
            engine.optim_step(aid, HP)
    for aid in HEALTHY:
        got, want = _params(shared, aid), _params(alone, aid)
        for key, value in want.items():
            torch.testing.assert_close(got[key], value, rtol=0, atol=1e-7, msg=f"{aid} after step {key}")
