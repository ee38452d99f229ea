"""What a scheduler's `ReplicaPool` says to the worker replicas of its base model, independent of transport.

A replica hosts one `Backend` (an `Engine`) and executes `ReplicaCall`s one at a time, in arrival order.
Calls that change an adapter carry the request id they execute, so a replica answers a repeated call
(a scheduler that took over re-dispatches what its predecessor had in flight) from its memory instead of
applying the step twice. Calls that establish an adapter's state (create, load, copy) and every K-th
optimizer step carry a `SnapshotOrder`: after applying the call the replica writes the adapter's weights,
optimizer state and pending gradients there, which `RestoreCall` later reads back on another replica.

The pool reaches replicas through a `ReplicaLink` (Redis in production: `redis_replicas`); tests may use
any other. Everything here pickles through the jobqueue codec.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Protocol, runtime_checkable

from services.domain.backend import BaseModelInfo
from services.domain.sampling import SampleWork
from services.domain.training import AdamParams, AdapterId, ForwardBackwardWork, LoraSpec
from services.domain.validation import ModelLimits

RequestTag = str | None
"""The request a call (or one work of a pass) executes; None when the caller does not know it."""


class ReplicaGone(ConnectionError):
    """The replica stopped answering (heartbeat expired, or it left): fail over, then retry the call."""

    def __init__(self, replica_id: str, reason: str) -> None:
        super().__init__(f"replica {replica_id} is gone: {reason}")
        self.replica_id = replica_id


class ReplicaCallError(RuntimeError):
    """The replica is alive but the call raised there; the message carries the remote error."""


class Fenced(ReplicaCallError):
    """A replica refused the call: a newer scheduler holds this base model's lease."""


@dataclass(frozen=True)
class SnapshotOrder:
    """Write the adapter's full state to `path` once the call is applied; then delete `retire`, if any."""

    path: str
    retire: str | None = None


@dataclass(frozen=True)
class PassEntry:
    """One adapter's share of a dispatched forward/backward pass: (request, work) pairs in pass order."""

    items: tuple[tuple[RequestTag, ForwardBackwardWork], ...]


@dataclass(frozen=True)
class OptimEntry:
    request_id: RequestTag
    params: AdamParams


LogEntry = PassEntry | OptimEntry
"""What the durability log keeps per adapter between snapshots: exactly the calls that change it."""


@dataclass(frozen=True)
class PassCall:
    items: tuple[tuple[RequestTag, ForwardBackwardWork], ...]


@dataclass(frozen=True)
class OptimCall:
    request_id: RequestTag
    adapter_id: AdapterId
    params: AdamParams
    snapshot: SnapshotOrder | None = None


@dataclass(frozen=True)
class CreateCall:
    request_id: RequestTag
    adapter_id: AdapterId
    spec: LoraSpec
    snapshot: SnapshotOrder


@dataclass(frozen=True)
class LoadCall:
    request_id: RequestTag
    adapter_id: AdapterId
    path: str
    with_optimizer: bool
    snapshot: SnapshotOrder


@dataclass(frozen=True)
class CopyCall:
    """A weights-only copy of `source` as `target` on the same replica (ephemeral samplers)."""

    request_id: RequestTag
    source: AdapterId
    target: AdapterId
    snapshot: SnapshotOrder


@dataclass(frozen=True)
class SaveCall:
    adapter_id: AdapterId
    path: str
    with_optimizer: bool
    age_recipients: tuple[str, ...] = ()
    """Non-empty: an age-encrypted export, encrypted on the replica before it reaches storage."""


@dataclass(frozen=True)
class SampleCall:
    works: tuple[SampleWork, ...]


@dataclass(frozen=True)
class DropCall:
    adapter_id: AdapterId


@dataclass(frozen=True)
class RestoreCall:
    """Rebuild an adapter from its snapshot and replay the logged calls since, in order. `applied` (request
    id, result) pairs are requests the snapshot already contains: the replica remembers them as applied, so
    a successor scheduler re-sending one gets its result instead of a second step."""

    adapter_id: AdapterId
    snapshot_path: str
    log: tuple[LogEntry, ...]
    applied: tuple[tuple[str, object], ...] = ()


ReplicaCall = (PassCall | OptimCall | CreateCall | LoadCall | CopyCall | SaveCall | SampleCall | DropCall
               | RestoreCall)


@dataclass(frozen=True)
class Envelope:
    """A call on the wire: where to answer, and the caller's fencing token (its lease generation)."""

    call_id: str
    reply_to: str
    fence: int
    call: ReplicaCall


@dataclass(frozen=True)
class Reply:
    """`value` is the call's result; `error` (with `fenced`) says the call raised on the replica instead."""

    call_id: str
    value: object = None
    error: str | None = None
    fenced: bool = False


@dataclass(frozen=True)
class ReplicaInfo:
    """How a replica registers itself (membership hash)."""

    replica_id: str
    base_model: str
    host: str
    pid: int
    started_at: float

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> ReplicaInfo:
        return cls(**json.loads(text))


@dataclass(frozen=True)
class PublishedModel:
    """What workers publish about their base model for gateways: its info and validation limits."""

    info: BaseModelInfo
    limits: ModelLimits

    def to_json(self) -> str:
        return json.dumps({"info": asdict(self.info), "limits": asdict(self.limits)})

    @classmethod
    def from_json(cls, text: str | bytes) -> PublishedModel:
        raw = json.loads(text)
        info = dict(raw["info"])
        info["eos_token_ids"] = tuple(info["eos_token_ids"])
        return cls(BaseModelInfo(**info), ModelLimits(**raw["limits"]))


@runtime_checkable
class ReplicaLink(Protocol):
    """The pool's view of one base model's replicas."""

    def live_replicas(self) -> list[str]:
        """Ids of the replicas whose heartbeat is current, sorted."""
        ...

    def alive(self, replica_id: str) -> bool:
        """Whether the replica still beats (a short gap, e.g. while Redis restarts, does not count)."""
        ...

    def call(self, replica_id: str, call: ReplicaCall, fence: int) -> object:
        """Run `call` on the replica and return its result. Raises `ReplicaGone` if the replica dies (or is
        not live) before answering, `Fenced` / `ReplicaCallError` if the call raised there."""
        ...

    def forget(self, replica_id: str) -> None:
        """Drop a dead replica's registration and inbox (idempotent)."""
        ...

    def published_model(self) -> PublishedModel | None:
        """The base model's info as the workers published it, if any worker did yet."""
        ...
