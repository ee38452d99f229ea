"""Checkpoint storage from settings: the local directory store, or S3 with each worker's backend staged.

`checkpoint_store(settings)` is what the control plane (every gateway) and every worker build;
`staged_backend(engine, store)` wraps a worker's engine so that saves into / loads from S3 checkpoint
paths go through the bucket (a local store needs no wrapper: its paths are the files).
"""

from __future__ import annotations

from typing import Any

from deploy.settings import ServiceSettings
from services.storage import LocalCheckpointStore, UrlSigner, load_or_create_secret
from services.storage.protocol import CheckpointStore
from services.storage.s3 import S3CheckpointStore, build_s3_store
from services.storage.staging import StagedBackend


def checkpoint_store(settings: ServiceSettings) -> CheckpointStore:
    """The store `CARPOOL_STORAGE_URL` names: S3 for `s3://...`, else `<data_dir>/checkpoints`."""
    if settings.storage_url:
        return build_s3_store(settings.storage_url, cache_dir=settings.resolved_s3_cache_dir,
                              cache_max_bytes=settings.s3_cache_max_bytes, endpoint_url=settings.s3_endpoint_url,
                              multipart_threshold=settings.s3_multipart_threshold_bytes,
                              timeout_s=settings.s3_timeout_seconds)
    signer = UrlSigner(load_or_create_secret(settings.signing_secret_path))
    return LocalCheckpointStore(settings.checkpoints_dir, signer)


def staged_backend(engine: Any, store: CheckpointStore) -> Any:
    """`engine` itself with a local store; with S3, an engine whose checkpoint saves/loads use the bucket."""
    return StagedBackend(engine, store) if isinstance(store, S3CheckpointStore) else engine
