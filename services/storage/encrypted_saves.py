"""Saving an age-encrypted export on whichever node holds the adapter, so plaintext never reaches storage.

`save_weights_external(age_encryption_recipients=...)` stores only `<file>.age`. With a local store the
adapter is written into its checkpoint directory and encrypted there before the row is recorded. With a
remote store (S3) that is too late: the staged save uploads as soon as the engine has written, so the
encryption must run on the private staging directory *before* the upload (`StagedBackend`), and in cluster
mode on the replica that holds the adapter (`ReplicaPool` forwards the recipients in its `SaveCall`). A
layer that can do this offers `save_encrypted_adapter`; `save_encrypted` uses it when the backend it is
given has one, and otherwise saves and encrypts in place.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

from services.domain.backend import Backend
from services.domain.training import AdapterId
from services.storage.encryption import EncryptionError, encrypt_directory
from services.storage.protocol import StorageError


class EncryptingBackend(Protocol):
    """A backend that saves an adapter's weights as an encrypted export itself (staged or remote)."""

    def save_encrypted_adapter(self, adapter_id: AdapterId, path: Path, *, recipients: tuple[str, ...]) -> int: ...


def save_encrypted(backend: Backend, adapter_id: AdapterId, path: Path, recipients: Sequence[str]) -> int:
    """Save `adapter_id`'s weights (no optimizer state) to `path`, every file age-encrypted to `recipients`.

    Returns the stored (encrypted) size. Raises `EncryptionError` when encryption fails (nothing is kept)."""
    delegate = getattr(backend, "save_encrypted_adapter", None)
    if delegate is not None:
        return int(delegate(adapter_id, Path(path), recipients=tuple(recipients)))
    backend.save_adapter(adapter_id, Path(path), with_optimizer=False)
    return encrypt_in_place(Path(path), recipients)


def encrypt_in_place(path: Path, recipients: Sequence[str]) -> int:
    """`encrypt_directory`, removing the whole directory on failure (an export is never left half plain)."""
    try:
        return encrypt_directory(path, recipients)
    except BaseException as exc:
        shutil.rmtree(path, ignore_errors=True)
        if isinstance(exc, StorageError) or not isinstance(exc, Exception):
            raise
        raise EncryptionError(f"{type(exc).__name__}: {exc}") from exc
