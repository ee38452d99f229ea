"""The `CheckpointStore` Protocol: where checkpoint bytes live, independent of the backend that holds them.

The database keeps a checkpoint's metadata and its `storage_uri`; a store turns that URI into a directory a
worker on this node can write or read (`local_path`), deletes it, measures it, lists its files and hands out
signed, expiring download URLs for them. `LocalCheckpointStore` (a directory tree) is the embedded
implementation; an S3-compatible store can implement the same Protocol by staging files in a local cache.
"""

from __future__ import annotations

from datetime import datetime
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

CheckpointKind = Literal["training", "sampler", "external"]
CHECKPOINT_KINDS: tuple[CheckpointKind, ...] = ("training", "sampler", "external")


class StorageError(Exception):
    """A storage URI or operation that cannot be served (bad URI, missing checkpoint)."""


class InvalidToken(StorageError):
    """A download token that is malformed, forged, expired, or names no file any more."""


@runtime_checkable
class CheckpointStore(Protocol):
    """Checkpoint directories addressed by an opaque URI (what `CheckpointRow.storage_uri` holds)."""

    remote: bool
    """False: `local_path` holds the files. True: it is a cache path that workers fill from the store."""

    def uri_for(self, tenant_id: str, training_run_id: str, kind: CheckpointKind, name: str) -> str:
        """The URI of checkpoint `name` of a run (nothing is created)."""
        ...

    def local_path(self, uri: str) -> Path:
        """A local directory for the checkpoint: where a worker writes it or reads it from."""
        ...

    def exists(self, uri: str) -> bool: ...

    def delete(self, uri: str) -> bool:
        """Remove the checkpoint's files; False if there was nothing to remove."""
        ...

    def size(self, uri: str) -> int:
        """Total bytes of the checkpoint's files (0 when missing)."""
        ...

    def list_files(self, uri: str) -> list[str]:
        """The checkpoint's files as `/`-separated paths relative to its directory, sorted."""
        ...

    def copy_checkpoint(self, source_uri: str, target_uri: str) -> None:
        """Copy a checkpoint's files to another URI; `StorageError` if the source has none."""
        ...

    def download_urls(self, uri: str, base_url: str, expires_at: datetime, *,
                      version: str | None = None) -> dict[str, str]:
        """Relative file path → absolute URL that downloads it until `expires_at`."""
        ...
