"""`StagedBackend`: a worker's `Backend` that moves checkpoints through a remote store (S3) transparently.

The control plane names checkpoints by `store.local_path(uri)`; with a remote store that is a cache
directory, which on another node may not exist yet. This wrapper sits between the runtime and the engine
on the node that holds the adapter: a save into such a path is written to a private staging directory,
uploaded (manifest last) and only then reported done; a load from such a path first fetches the verified
checkpoint into this node's cache. An age-encrypted export is encrypted in the staging directory before
its upload (`save_encrypted_adapter`), so the bucket never holds its plaintext. Every other path
(snapshots, scratch copies) passes straight through.
Upload and download failures raise `StorageError`, which the runtime turns into a `server` error of that
one request while the adapter keeps training.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from services.domain.backend import Backend, BaseModelInfo
from services.domain.sampling import SampleResult, SampleWork
from services.domain.training import (
    AdamParams,
    AdapterId,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
    OptimStepResult,
    WorkError,
)
from services.storage.durability import mark_scratch
from services.storage.encrypted_saves import encrypt_in_place, save_encrypted

_STAGED_NAME = "checkpoint"


class RemoteStore(Protocol):
    """What a worker needs of a remote checkpoint store (`S3CheckpointStore` implements it)."""

    def uri_of_local_path(self, path: Path) -> str | None: ...

    def upload(self, uri: str, directory: Path) -> int: ...

    def fetch(self, uri: str) -> Path: ...

    def staging_dir(self) -> Path: ...


class StagedBackend:
    """Delegates to `inner`; saves into / loads from the store's paths go through the store."""

    def __init__(self, inner: Backend, store: RemoteStore) -> None:
        self._inner = inner
        self._store = store

    def __getattr__(self, name: str) -> Any:
        # Engine extras the runtime probes for (`limits`, `copy_adapter`, ...) stay the engine's own.
        return getattr(self._inner, name)

    @property
    def info(self) -> BaseModelInfo:
        return self._inner.info

    def create_adapter(self, adapter_id: AdapterId, spec: LoraSpec) -> None:
        self._inner.create_adapter(adapter_id, spec)

    def drop_adapter(self, adapter_id: AdapterId) -> None:
        self._inner.drop_adapter(adapter_id)

    def has_adapter(self, adapter_id: AdapterId) -> bool:
        return self._inner.has_adapter(adapter_id)

    def forward_backward(self, works: Sequence[ForwardBackwardWork]) -> list[ForwardBackwardResult | WorkError]:
        return self._inner.forward_backward(works)

    def optim_step(self, adapter_id: AdapterId, params: AdamParams) -> OptimStepResult:
        return self._inner.optim_step(adapter_id, params)

    def sample(self, works: Sequence[SampleWork]) -> list[SampleResult | WorkError]:
        return self._inner.sample(works)

    def save_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> int:
        uri = self._store.uri_of_local_path(Path(path))
        if uri is None:
            return self._inner.save_adapter(adapter_id, path, with_optimizer=with_optimizer)
        return self._staged_save(uri, adapter_id, with_optimizer, prepare=None)

    def save_encrypted_adapter(self, adapter_id: AdapterId, path: Path, *, recipients: tuple[str, ...]) -> int:
        """An age-encrypted export: encrypted in the private staging directory, so the bucket never sees
        plaintext (see `services.storage.encrypted_saves`)."""
        uri = self._store.uri_of_local_path(Path(path))
        if uri is None:
            return save_encrypted(self._inner, adapter_id, path, recipients)
        return self._staged_save(uri, adapter_id, False, prepare=lambda d: encrypt_in_place(d, recipients))

    def _staged_save(self, uri: str, adapter_id: AdapterId, with_optimizer: bool,
                     prepare: Callable[[Path], object] | None) -> int:
        """Write into a private staging directory, let `prepare` transform it, then upload (manifest last)."""
        staging = self._store.staging_dir()
        # Not fsynced: the save is acknowledged once the bucket holds it, not the staging copy.
        mark_scratch(staging)
        try:
            self._inner.save_adapter(adapter_id, staging / _STAGED_NAME, with_optimizer=with_optimizer)
            if prepare is not None:
                prepare(staging / _STAGED_NAME)
            return self._store.upload(uri, staging / _STAGED_NAME)
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    def load_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> LoraSpec:
        uri = self._store.uri_of_local_path(Path(path))
        local = Path(path) if uri is None else self._store.fetch(uri)
        return self._inner.load_adapter(adapter_id, local, with_optimizer=with_optimizer)
