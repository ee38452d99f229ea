"""Command payloads: what the control plane puts on the queue for a base model's scheduler loop.

A `QueuedRequest` carries one of these as its opaque `payload`. Pass-kind work (`ForwardBackward`) and
sampling (`Sample`) are gathered by the loop into one backend call per planned pass or batch; every other
command is a barrier that runs on its own through `run(backend)`, which returns the request's outcome (an
`services.control.api` result type) or a `WorkError` for a failure that is the caller's fault.

Commands are plain frozen dataclasses of domain values and paths, so they pickle (a Redis queue can carry
them) and say everything the loop and its completion hook need: the hook writes the checkpoint row of a
successful `Save` from its `record`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Protocol, runtime_checkable

from services.control.api import CheckpointRef, ModelCreated, OptimStepDone, SamplerRef, WeightsLoaded
from services.db.ids import ModelId, SamplingSessionId
from services.domain.backend import Backend, copy_adapter
from services.domain.sampling import SampleWork
from services.domain.training import AdamParams, AdapterId, ForwardBackwardWork, LoraSpec, WorkError
from services.storage.local import claim_save, save_owner
from services.storage.protocol import CheckpointKind


@runtime_checkable
class BarrierCommand(Protocol):
    """A command that runs alone for its model: returns the outcome, or a `WorkError` (user's fault)."""

    def run(self, backend: Backend) -> object: ...


@dataclass(frozen=True)
class CheckpointRecord:
    """The checkpoint row to write once a save succeeded (ids as the database stores them)."""

    tenant_id: str
    training_run_id: str
    checkpoint_id: str
    """`weights/<name>`, `sampler_weights/<name>` or `external_weights/<name>`."""
    kind: CheckpointKind
    tinker_path: str
    storage_uri: str
    expires_at: datetime | None = None
    user_metadata: dict[str, str] = field(default_factory=dict)
    overwrite: bool = False
    save_token: str = ""
    """Names the submission (`<model>/<seq_id>`): a re-run of this very save after a crash finds its own
    earlier files by it and overwrites them, where a racing save of the same name is refused."""


@dataclass(frozen=True)
class CreateAdapter:
    """create_model: a fresh adapter for the model (its seq 0)."""

    model_id: ModelId
    adapter_id: AdapterId
    spec: LoraSpec

    def run(self, backend: Backend) -> object:
        backend.create_adapter(self.adapter_id, self.spec)
        return ModelCreated(self.model_id)


@dataclass(frozen=True)
class ForwardBackward:
    """forward / forward_backward: one request's share of a packed pass (run with others, never alone)."""

    work: ForwardBackwardWork


@dataclass(frozen=True)
class OptimStep:
    adapter_id: AdapterId
    params: AdamParams

    def run(self, backend: Backend) -> object:
        return OptimStepDone(dict(backend.optim_step(self.adapter_id, self.params).metrics))


@dataclass(frozen=True)
class Save:
    """save_weights / save_weights_for_sampler (named) / save_weights_external into a local directory."""

    adapter_id: AdapterId
    path: Path
    with_optimizer: bool
    kind: CheckpointKind
    record: CheckpointRecord

    def run(self, backend: Backend) -> object:
        clash = self.clash()
        if clash is not None:
            return clash
        size = backend.save_adapter(self.adapter_id, self.path, with_optimizer=self.with_optimizer)
        return CheckpointRef(self.record.tinker_path, self.kind, size)

    def clash(self) -> WorkError | None:
        """The control plane refused name clashes at submission; this catches two saves of one name racing.

        A directory this same submission wrote before a crash (scheduler and replica killed after the files
        were in place, before the result was stored) is not a clash: the successor re-runs the request and
        must overwrite its own attempt. Claims the name for this submission when it is free."""
        if self.record.overwrite:
            return None
        token = self.record.save_token
        if self.path.exists() and (not token or save_owner(self.path) != token):
            return WorkError(f"checkpoint {self.record.tinker_path} already exists; save under another name "
                             "or pass overwrite=True", "user")
        if token:
            claim_save(self.path, token)
        return None


@dataclass(frozen=True)
class Load:
    """load_weights (create-via-load at seq 0, or the legacy in-place load), and sampler checkpoint loads."""

    adapter_id: AdapterId
    path: Path
    with_optimizer: bool
    model_id: ModelId
    tinker_path: str
    remote: bool = False
    """`path` names a remote store's checkpoint, fetched by the worker's backend (not checkable here)."""

    def run(self, backend: Backend) -> object:
        if not self.remote and not self.path.is_dir():
            return WorkError(f"checkpoint {self.tinker_path} has no stored files", "user")
        backend.load_adapter(self.adapter_id, self.path, with_optimizer=self.with_optimizer)
        return WeightsLoaded(self.model_id, self.tinker_path)


@dataclass(frozen=True)
class CopyAdapter:
    """A weights-only snapshot of `source` as `target`, for an ephemeral sampler (snapshot semantics)."""

    source: AdapterId
    target: AdapterId
    sampling_session_id: SamplingSessionId
    scratch_dir: Path | None = None
    """Where the save-then-load round trip writes, when the backend has no `copy_adapter`."""

    def run(self, backend: Backend) -> object:
        copy_adapter(backend, self.source, self.target, self.scratch_dir)
        return SamplerRef(self.sampling_session_id)


@dataclass(frozen=True)
class Sample:
    """asample: one prompt's continuations; batched with other sessions' samples into one backend call."""

    work: SampleWork


Command = CreateAdapter | ForwardBackward | OptimStep | Save | Load | CopyAdapter | Sample
