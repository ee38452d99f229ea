"""A replica's view of checkpoint storage: with S3 configured, its engine saves and loads through the bucket.

Replicas never share a disk with the gateway in this mode: the control plane names a checkpoint by its S3
store path, and `StagedBackend` uploads after a save and fetches (verified, through this node's bounded
cache) before a load. Without S3 the engine is used as is (the shared-volume layout).
"""

from __future__ import annotations

from pathlib import Path

from services.domain.backend import Backend
from services.storage.s3 import build_s3_store
from services.storage.staging import StagedBackend
from worker.serve.config import ClusterConfig


def staged_engine(engine: Backend, config: ClusterConfig) -> Backend:
    storage = config.storage
    if storage is None:
        return engine
    cache_dir = Path(storage.cache_dir) if storage.cache_dir else Path(config.data_dir) / "s3-cache"
    store = build_s3_store(storage.url, cache_dir=cache_dir, cache_max_bytes=storage.cache_max_bytes,
                           endpoint_url=storage.endpoint_url, multipart_threshold=storage.multipart_threshold,
                           timeout_s=storage.timeout_s)
    return StagedBackend(engine, store)
