"""Tenancy through the control plane: several tenants share packed passes yet train exactly as alone, and
no tenant can reach another's sessions, models, requests, checkpoints or samplers (unless published)."""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import BASE, Harness, build_harness

from services.control.api import CheckpointRef, NotFound, SaveOptions
from services.db import database_url_for_data_dir
from services.db.ids import ModelId, RequestId, SamplingSessionId, SessionId
from services.domain.sampling import SampleWork, SamplingParams
from services.domain.training import (
    AdamParams,
    AdapterId,
    Datum,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
)
from worker.engine.engine import Engine, EngineConfig

STEPS = 3


@pytest.fixture
def packing_harness(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Harness]:
    # A wide batch window: every tenant's request of a step is queued before the loop plans the pass.
    h = build_harness(database_url_for_data_dir(tmp_path), tiny_model_dir, tmp_path, batch_window_s=0.5)
    yield h
    h.close()


def _datum(rng: np.random.Generator, n: int) -> Datum:
    seq = rng.integers(0, 512, n + 1)
    return Datum(seq[:-1], {"target_tokens": seq[1:], "weights": rng.uniform(0.5, 1.5, n).astype(np.float32)})


def _loss(result: object) -> float:
    assert isinstance(result, ForwardBackwardResult), result
    return result.metrics["loss:sum"]


def test_three_tenants_share_passes_and_train_as_if_alone(
    packing_harness: Harness, tiny_model_dir: Path
) -> None:
    h = packing_harness
    rng = np.random.default_rng(3)
    plans = {
        "alpha": (LoraSpec(rank=4, seed=1), AdamParams(learning_rate=1e-2)),
        "beta": (
            LoraSpec(rank=8, seed=2, train_mlp=False),
            AdamParams(learning_rate=3e-3, weight_decay=0.01),
        ),
        "gamma": (LoraSpec(rank=2, seed=3), AdamParams(learning_rate=2e-2, grad_clip_norm=1.0)),
    }
    data = {name: [[_datum(rng, int(rng.integers(4, 14)))] for _ in range(STEPS)] for name in plans}
    tenants = {name: h.tenant(name) for name in plans}
    models = {}
    for name, (spec, _) in plans.items():
        sub = h.run(h.control.create_model(tenants[name], h.session(tenants[name]), 0, BASE, spec, None))
        h.done(tenants[name], sub.request_id)
        models[name] = sub.model_id

    served: dict[str, list[float]] = {name: [] for name in plans}
    for step in range(STEPS):
        subs = {
            n: h.run(
                h.control.forward_backward(
                    tenants[n], models[n], 2 * step + 1, ForwardBackwardWork(None, data[n][step])
                )
            )
            for n in plans
        }
        opts = {
            n: h.run(h.control.optim_step(tenants[n], models[n], 2 * step + 2, plans[n][1])) for n in plans
        }
        for n in plans:
            served[n].append(_loss(h.done(tenants[n], subs[n].request_id)))
            h.done(tenants[n], opts[n].request_id)

    assert h.engine.stats.multi_adapter_passes > 0
    stats = h.control.runtime_stats()[0]
    assert stats.multi_tenant_passes > 0 and stats.mean_tenants_per_pass > 1

    alone = Engine(tiny_model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    for name, (spec, params) in plans.items():
        adapter = AdapterId(name)
        alone.create_adapter(adapter, spec)
        for step in range(STEPS):
            result = alone.forward_backward([ForwardBackwardWork(adapter, data[name][step])])[0]
            alone.optim_step(adapter, params)
            assert abs(served[name][step] - _loss(result)) <= 1e-5, (name, step)


def _not_found_message(h: Harness, call: Callable[[str], Coroutine[Any, Any, object]], ident: str) -> str:
    with pytest.raises(NotFound) as caught:
        h.run(call(ident))
    return caught.value.message.replace(ident, "<id>")


def test_another_tenants_ids_are_not_found(harness_on_each_database: Harness) -> None:
    h = harness_on_each_database
    a, b = h.tenant("alice"), h.tenant("bob")
    sa = h.session(a)
    sb = h.session(b)
    model = h.run(h.control.create_model(a, sa, 0, BASE, LoraSpec(rank=2, seed=0), None)).model_id
    rng = np.random.default_rng(4)
    fb = h.run(h.control.forward_backward(a, model, 1, ForwardBackwardWork(None, [_datum(rng, 6)])))
    saved = h.run(h.control.save(a, model, 2, "sampler", SaveOptions(name="snap")))
    path = h.done(a, saved.request_id)
    assert isinstance(path, CheckpointRef)
    sampler = h.run(h.control.create_sampling_session(a, sa, 0, model_path=path.tinker_path, base_model=None))
    prompt = SampleWork(None, np.array([1, 2, 3]), params=SamplingParams(max_tokens=2))
    c = h.control

    probes: list[tuple[Callable[[str], Coroutine[Any, Any, object]], str, str]] = [
        (lambda i: c.create_model(b, SessionId(i), 0, BASE, LoraSpec(rank=2), None), sa, "sess-missing"),
        (lambda i: c.heartbeat(b, SessionId(i)), sa, "sess-missing"),
        (lambda i: c.get_session(b, SessionId(i)), sa, "sess-missing"),
        (
            lambda i: c.create_sampling_session(b, SessionId(i), 0, model_path=None, base_model=BASE),
            sa,
            "sess-missing",
        ),
        (lambda i: c.get_info(b, ModelId(i)), model, f"{sb}:train:7"),
        (
            lambda i: c.forward_backward(b, ModelId(i), 2, ForwardBackwardWork(None, [_datum(rng, 4)])),
            model,
            f"{sb}:train:7",
        ),
        (lambda i: c.optim_step(b, ModelId(i), 2, AdamParams()), model, f"{sb}:train:7"),
        (lambda i: c.reject_seq_id(b, ModelId(i), 3, "nope"), model, f"{sb}:train:7"),
        (lambda i: c.get_training_run(b, ModelId(i)), model, f"{sb}:train:7"),
        (lambda i: c.retrieve(b, RequestId(i), 0.0), fb.request_id, "req-missing"),
        (lambda i: c.cancel(b, RequestId(i)), fb.request_id, "req-missing"),
        (lambda i: c.get_checkpoint(b, i), path.tinker_path, f"tinker://{model}/sampler_weights/other"),
        (lambda i: c.delete_checkpoint(b, i), path.tinker_path, f"tinker://{model}/sampler_weights/other"),
        (
            lambda i: c.set_checkpoint_public(b, i, True),
            path.tinker_path,
            f"tinker://{model}/sampler_weights/x",
        ),
        (
            lambda i: c.load(b, path=i, with_optimizer=False, session_id=sb, model_seq_id=0),
            path.tinker_path,
            f"tinker://{model}/sampler_weights/other",
        ),
        (
            lambda i: c.create_sampling_session(b, sb, 1, model_path=i, base_model=None),
            path.tinker_path,
            f"tinker://{model}/sampler_weights/other",
        ),
        (lambda i: c.get_sampler(b, SamplingSessionId(i)), sampler, f"{sb}:sample:9"),
        (lambda i: c.sample(b, SamplingSessionId(i), 0, prompt), sampler, f"{sb}:sample:9"),
    ]
    for call, theirs, missing in probes:
        assert _not_found_message(h, call, theirs) == _not_found_message(h, call, missing)

    # Bob's attempts left Alice's model untouched: her next seq id still runs.
    nxt = h.run(h.control.forward_backward(a, model, 3, ForwardBackwardWork(None, [_datum(rng, 5)])))
    assert _loss(h.done(a, nxt.request_id)) > 0
    assert not h.run(h.control.list_training_runs(b, 10, 0))[0]

    # Once Alice publishes the checkpoint, Bob may read and sample it (but still not change it).
    h.run(h.control.set_checkpoint_public(a, path.tinker_path, True))
    view, run = h.run(h.control.get_checkpoint(b, path.tinker_path))
    assert view.public and run.training_run_id == model
    assert h.run(h.control.create_sampling_session(b, sb, 2, model_path=path.tinker_path, base_model=None))
    with pytest.raises(NotFound):
        h.run(h.control.delete_checkpoint(b, path.tinker_path))


def test_ownership_memory_learns_only_the_owners_models(harness: Harness) -> None:
    """What the edge's forward_backward skips its per-step lookup on: true only after `get_info` found the
    model to be the caller's; another tenant's or an unknown id is never remembered (404 each time)."""
    h = harness
    a, b = h.tenant("alice"), h.tenant("bob")
    model = h.run(h.control.create_model(a, h.session(a), 0, BASE, LoraSpec(rank=2, seed=0), None)).model_id
    assert not h.control.model_known_owned(a, model)  # nothing looked up yet
    for _ in range(2):
        with pytest.raises(NotFound):
            h.run(h.control.get_info(b, model))
        with pytest.raises(NotFound):
            h.run(h.control.get_info(a, ModelId("sess-x:train:9")))
    assert not h.control.model_known_owned(b, model)
    assert not h.control.model_known_owned(a, ModelId("sess-x:train:9"))
    assert h.run(h.control.get_info(a, model)).model_id == model
    assert h.control.model_known_owned(a, model) and not h.control.model_known_owned(b, model)
