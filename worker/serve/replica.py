"""`ReplicaHost`: one worker replica — an `Engine` for one base model, registered in Redis, serving its inbox.

Ray Serve hosts one `ReplicaHost` per replica (`worker.serve.app`); tests and single-process tools may
host them directly on threads. Start-up order matters: the engine loads first, and only then does the
replica register and start its heartbeat, so a scheduler never places an adapter on a replica that
cannot run it yet. Each replica has its own id (a fresh one per process: a restarted replica is a new
member, and the scheduler restores the old one's adapters from their snapshots).
"""

from __future__ import annotations

import logging
import os
import socket
import time
import uuid
from pathlib import Path

from services.runtime.redis_replicas import ClusterKeys, RedisReplicaEndpoint, connect
from services.runtime.replica_executor import ReplicaExecutor
from services.runtime.replica_protocol import PublishedModel, ReplicaInfo
from services.storage import safe_component
from worker.engine.engine import Engine, EngineConfig
from worker.models.sources import resolve_model_source
from worker.serve.config import ClusterConfig, WorkerSpec
from worker.serve.storage import staged_engine

log = logging.getLogger(__name__)


class ReplicaHost:
    """Loads the engine, then registers and serves until `stop()`."""

    def __init__(self, spec: WorkerSpec, config: ClusterConfig, *, replica_id: str | None = None) -> None:
        self.spec = spec
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        started = time.perf_counter()
        self.engine = self._load_engine(spec, config)
        keys = ClusterKeys(spec.name, config.prefix)
        info = ReplicaInfo(self.replica_id, spec.name, socket.gethostname(), os.getpid(), time.time())
        published = PublishedModel(self.engine.info, self.engine.limits)
        self._executor = ReplicaExecutor(staged_engine(self.engine, config),
                                         scratch_dir=Path(config.data_dir) / "scratch")
        self._endpoint = RedisReplicaEndpoint(connect(config.redis_url), keys, info, published,
                                              heartbeat_ttl_s=config.heartbeat_ttl_seconds)
        self._endpoint.start(self._executor.handle)
        log.info("replica %s of %s serving (pid %d, ready in %.1f s)", self.replica_id, spec.name, os.getpid(),
                 time.perf_counter() - started)

    @property
    def healthy(self) -> bool:
        return self._endpoint.healthy

    def stop(self, *, leave: bool = True) -> None:
        """Stop serving; `leave=False` keeps the registration, as a crash would (tests of fail-over)."""
        self._endpoint.stop(leave=leave)

    def _load_engine(self, spec: WorkerSpec, config: ClusterConfig) -> Engine:
        path = resolve_model_source(spec.source, config.models_dir)
        spill = Path(config.data_dir) / "spill" / safe_component(spec.name) / self.replica_id
        engine_config = EngineConfig(max_tokens_per_pass=spec.max_tokens_per_pass,
                                     max_resident_adapters=spec.max_resident_adapters, spill_dir=spill,
                                     device=spec.device, dtype=spec.dtype,
                                     micro_batch_tokens=spec.micro_batch_tokens,
                                     keep_freed_host_memory=spec.keep_freed_host_memory)
        return Engine(path, name=spec.name, config=engine_config)
