"""Checkpoint storage: the `CheckpointStore` Protocol, a local-directory store, and signed download tokens."""

from services.storage.local import DOWNLOAD_ROUTE, LocalCheckpointStore, safe_component
from services.storage.protocol import (
    CHECKPOINT_KINDS,
    CheckpointKind,
    CheckpointStore,
    InvalidToken,
    StorageError,
)
from services.storage.signing import UrlSigner, load_or_create_secret

__all__ = [
    "CHECKPOINT_KINDS",
    "DOWNLOAD_ROUTE",
    "CheckpointKind",
    "CheckpointStore",
    "InvalidToken",
    "LocalCheckpointStore",
    "StorageError",
    "UrlSigner",
    "load_or_create_secret",
    "safe_component",
]
