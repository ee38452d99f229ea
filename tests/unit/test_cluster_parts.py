"""The Ray- and Redis-free parts of cluster mode: the replica executor's fencing, exactly-once and
snapshots, take-over positions of the recovering scheduler, and the TOML worker config."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from services.domain.training import (
    AdamParams,
    AdapterId,
    Datum,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
    OptimStepResult,
)
from services.runtime.recovery import Position, RecoveringScheduler
from services.runtime.replica_executor import ReplicaExecutor
from services.runtime.replica_protocol import (
    CopyCall,
    CreateCall,
    Envelope,
    OptimCall,
    OptimEntry,
    PassCall,
    PassEntry,
    RestoreCall,
    SnapshotOrder,
)
from services.scheduler import ModelId, QueuedRequest, RequestId, RequestKind, TenantId
from worker.serve.config import ClusterConfig, ClusterConfigError, parse_cluster_config

A = AdapterId("a")


class FakeBackend:
    """Records what ran; saves write a marker directory."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def create_adapter(self, adapter_id: AdapterId, spec: LoraSpec) -> None:
        self.calls.append(f"create {adapter_id}")

    def forward_backward(self, works: Sequence[ForwardBackwardWork]) -> list[ForwardBackwardResult]:
        self.calls.append(f"pass {len(works)}")
        return [ForwardBackwardResult([], {"loss:sum": float(i)}) for i, _ in enumerate(works)]

    def optim_step(self, adapter_id: AdapterId, params: AdamParams) -> OptimStepResult:
        self.calls.append(f"optim {adapter_id}")
        return OptimStepResult({"step": float(len(self.calls))})

    def save_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> int:
        path.mkdir(parents=True, exist_ok=True)
        self.calls.append(f"save {adapter_id}")
        return 1

    def load_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> LoraSpec:
        self.calls.append(f"load {adapter_id} from {path.name}")
        return LoraSpec()


def work() -> ForwardBackwardWork:
    tokens = np.arange(1, 6)
    return ForwardBackwardWork(A, [Datum(tokens[:-1], {"target_tokens": tokens[1:]})])


def envelope(call: object, fence: int = 1) -> Envelope:
    return Envelope("c", "reply", fence, call)  # type: ignore[arg-type]


def test_a_request_applied_once_is_answered_from_memory_when_sent_again() -> None:
    backend = FakeBackend()
    executor = ReplicaExecutor(backend)  # type: ignore[arg-type]
    first = executor.handle(envelope(PassCall((("r1", work()),))))
    again = executor.handle(envelope(PassCall((("r1", work()), ("r2", work())))))
    assert backend.calls == ["pass 1", "pass 1"]  # only r2 ran the second time
    assert again.value[0] is first.value[0]  # type: ignore[index]
    step = executor.handle(envelope(OptimCall("r3", A, AdamParams())))
    assert executor.handle(envelope(OptimCall("r3", A, AdamParams()))).value is step.value
    assert backend.calls.count(f"optim {A}") == 1


def test_calls_of_an_older_lease_generation_are_refused() -> None:
    executor = ReplicaExecutor(FakeBackend())  # type: ignore[arg-type]
    assert executor.handle(envelope(OptimCall("r1", A, AdamParams()), fence=5)).error is None
    refused = executor.handle(envelope(OptimCall("r2", A, AdamParams()), fence=4))
    assert refused.fenced and "generation 4" in (refused.error or "")


def test_snapshots_are_written_after_the_call_and_the_superseded_one_retired(tmp_path: Path) -> None:
    backend = FakeBackend()
    executor = ReplicaExecutor(backend)  # type: ignore[arg-type]
    old = tmp_path / "old"
    old.mkdir()
    executor.handle(envelope(CreateCall("r0", A, LoraSpec(), SnapshotOrder(str(tmp_path / "s1"), str(old)))))
    assert backend.calls == [f"create {A}", f"save {A}"]
    assert (tmp_path / "s1").is_dir() and not old.exists()


def test_restore_loads_the_snapshot_then_replays_the_log_in_order(tmp_path: Path) -> None:
    backend = FakeBackend()
    executor = ReplicaExecutor(backend)  # type: ignore[arg-type]
    log = (PassEntry((("r1", work()),)), OptimEntry("r2", AdamParams()), PassEntry((("r3", work()),)))
    assert executor.handle(envelope(RestoreCall(A, str(tmp_path / "snap"), log))).value == 3
    assert backend.calls == [f"load {A} from snap", "pass 1", f"optim {A}", "pass 1"]
    executor.handle(envelope(PassCall((("r3", work()),))))  # the interrupted call, sent again
    assert backend.calls[-1] == "pass 1" and len(backend.calls) == 4


class CopyingBackend(FakeBackend):
    """A backend that copies adapters in memory (the engine's `copy_adapter`)."""

    def copy_adapter(self, source: AdapterId, target: AdapterId) -> None:
        self.calls.append(f"copy {source} to {target}")


@pytest.mark.parametrize("backend_type", [FakeBackend, CopyingBackend])
def test_a_sampler_copy_runs_once_and_its_snapshot_is_written(tmp_path: Path,
                                                               backend_type: type[FakeBackend]) -> None:
    backend = backend_type()
    executor = ReplicaExecutor(backend, scratch_dir=tmp_path / "scratch")  # type: ignore[arg-type]
    target = AdapterId("a-sampler")
    call = CopyCall("r1", A, target, SnapshotOrder(str(tmp_path / "s1"), None))
    assert executor.handle(envelope(call)).error is None
    executor.handle(envelope(call))  # sent again: answered from memory
    copied = ([f"copy {A} to {target}"] if backend_type is CopyingBackend
              else [f"save {A}", f"load {target} from copy"])
    # The copy ran once; its snapshot is written after each delivery of the call (an idempotent write).
    assert backend.calls == [*copied, f"save {target}", f"save {target}"]
    assert (tmp_path / "s1").is_dir()


def request(seq: int, model: str = "m") -> QueuedRequest:
    return QueuedRequest(RequestId(f"{model}-{seq}"), TenantId("t"), ModelId(model), RequestKind.FORWARD_BACKWARD,
                         seq, num_tokens=4)


def test_a_successor_resumes_each_model_at_its_durable_position() -> None:
    scheduler = RecoveringScheduler(lambda model: Position(7, frozenset({"m-5"})) if model == "m" else Position(0))
    assert scheduler.submit(request(6)) == (RequestId("m-6"), False, False)  # finished before: just acked
    assert scheduler.submit(request(5)) == (RequestId("m-5"), False, True)  # ran, not recorded: record it
    assert scheduler.submit(request(5)).unrecorded is False  # once
    assert scheduler.submit(request(8)).is_new
    assert scheduler.submit(request(7)).is_new
    assert [r.seq_id for item in scheduler.step().items for r in item.requests] == [7, 8]
    assert scheduler.submit(request(0, "new")).is_new  # a model nobody ran yet starts at 0


def test_worker_config_merges_toml_over_settings_and_rejects_unknown_keys(tmp_path: Path) -> None:
    defaults = ClusterConfig(redis_url="redis://r", data_dir=str(tmp_path))
    raw = {"cluster": {"prefix": "p", "data_dir": "rel", "env": {"X": 1}},
           "base_model": [{"name": "m", "source": "/m", "replicas": 2, "num_gpus": 1}]}
    config = parse_cluster_config(raw, defaults)
    assert config.prefix == "p" and config.redis_url == "redis://r" and config.env == {"X": "1"}
    assert Path(config.data_dir).is_absolute()
    assert config.spec("m").replicas == 2 and config.spec("m").num_gpus == 1
    with pytest.raises(ClusterConfigError, match="unknown keys"):
        parse_cluster_config({"base_model": [{"name": "m", "source": "s", "gpus": 1}]}, defaults)
    with pytest.raises(ClusterConfigError, match="no \\[\\[base_model\\]\\]"):
        parse_cluster_config({}, defaults)
