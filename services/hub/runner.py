"""`PushRunner`: one attempt of one hub push, the same code under Celery (`carpool hub-worker`) and in-process.

An attempt claims the push (queued|running → running, attempts + 1), materialises the checkpoint (a
local directory, or fetched and verified from S3), builds the upload folder (adapter + model card),
resolves the token (the tenant's, decrypted here and nowhere else, else the operator's) and calls the
hub client. It ends the push `done` (hub revision and URL) or `failed` (the error text), or asks to be
retried after a backoff when the failure was transient and retries remain. The caller (a Celery task or
`InProcessDispatcher`) owns the waiting; the push row owns the truth, so a redelivered task after a
worker crash resumes where the row says, and the hub client never commits the same files twice.
"""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from services.db import Database
from services.db.hub_pushes import claim_hub_push, finish_hub_push, get_hub_credential
from services.db.ids import HubPushId, ModelId, TenantId
from services.db.models import CheckpointRow, HubTarget
from services.db.runs import get_training_run
from services.hub.card import CardError, CardFacts, build_upload_folder, read_steps
from services.hub.clients import HubClient, HubError, PushRequest, PushResult
from services.hub.credentials import CredentialError, TokenCipher
from services.storage.protocol import CheckpointStore, StorageError

log = logging.getLogger(__name__)

HUB_NAMES: dict[HubTarget, str] = {"hf": "huggingface", "ms": "modelscope"}


@dataclass(frozen=True)
class RetryIn:
    """Try again after `seconds` (a transient failure with retries left)."""

    seconds: float
    error: str


@dataclass(frozen=True)
class Finished:
    status: str
    """done, failed, or skipped (the push had already finished: a duplicate delivery)."""


@dataclass(frozen=True)
class _Job:
    push_id: HubPushId
    tenant_id: TenantId
    target: HubTarget
    repo: str
    private: bool
    revision: str | None
    commit_message: str | None
    tinker_path: str
    storage_uri: str | None
    base_model: str
    rank: int
    training_run_id: str
    ciphertext: str | None


class PushRunner:
    """Runs push attempts against `clients` (`hf`/`ms` → client); `operator_tokens` are the fallbacks."""

    def __init__(self, db: Database, store: CheckpointStore, clients: Mapping[HubTarget, HubClient],
                 cipher: TokenCipher, *, operator_tokens: Mapping[HubTarget, str] | None = None,
                 max_retries: int = 4, backoff_s: float = 2.0, scratch_dir: Path | None = None,
                 on_finished: Callable[[str, str], None] | None = None) -> None:
        self._db = db
        self._on_finished = on_finished or (lambda hub, outcome: None)
        """(hub, done|failed) of each finished push: the process's `carpool_hub_pushes_total`."""
        self._store = store
        self._clients = clients
        self._cipher = cipher
        self._operator_tokens = dict(operator_tokens or {})
        self.max_retries = max_retries
        self._backoff_s = backoff_s
        self._scratch_dir = scratch_dir

    def run(self, push_id: int, attempt: int) -> RetryIn | Finished:
        """One attempt; `attempt` counts from 0 (Celery's `request.retries`)."""
        job = self._claim(HubPushId(push_id))
        if job is None:
            return Finished("skipped")
        token = None
        try:
            token = self._token(job)
            result = self._push(job, token)
        except HubError as exc:
            message = _redact(str(exc), token)
            if exc.transient and attempt < self.max_retries:
                delay = self._backoff_s * (2 ** attempt)
                log.warning("hub push %s: %s; retry %d/%d in %.1f s", push_id, message, attempt + 1,
                            self.max_retries, delay)
                return RetryIn(delay, message)
            tries = f" after {attempt + 1} attempts" if exc.transient else ""
            return self._fail(job, f"push to {HUB_NAMES[job.target]} repo {job.repo} failed{tries}: {message}")
        except (CardError, CredentialError, StorageError) as exc:
            return self._fail(job, f"push of {job.tinker_path} failed: {_redact(str(exc), token)}")
        with self._db.sessions.begin() as db:
            finish_hub_push(db, job.push_id, "done", hub_revision=result.revision, url=result.url)
        log.info("hub push %s done: %s (%s)", push_id, result.url, "new commit" if result.created else "existing")
        self._on_finished(job.target, "done")
        return Finished("done")

    # -- steps ------------------------------------------------------------------------------------
    def _claim(self, push_id: HubPushId) -> _Job | None:
        with self._db.sessions.begin() as db:
            row = claim_hub_push(db, push_id)
            if row is None:
                return None
            checkpoint = db.get(CheckpointRow, row.checkpoint_id) if row.checkpoint_id is not None else None
            run = (get_training_run(db, row.tenant_id, ModelId(checkpoint.training_run_id))
                   if checkpoint is not None else None)
            return _Job(push_id, row.tenant_id, row.target, row.repo, row.private, row.revision,
                        row.commit_message, row.tinker_path,
                        checkpoint.storage_uri if checkpoint is not None else None,
                        run.base_model if run is not None else "unknown", run.lora_rank if run is not None else 0,
                        checkpoint.training_run_id if checkpoint is not None else "unknown",
                        get_hub_credential(db, row.tenant_id, row.target))

    def _token(self, job: _Job) -> str:
        if job.ciphertext is not None:
            return self._cipher.decrypt(job.ciphertext)
        token = self._operator_tokens.get(job.target)
        if not token:
            raise CredentialError(f"no {HUB_NAMES[job.target]} token: store one with "
                                  f"PUT /v1/hub_credentials/{HUB_NAMES[job.target]}")
        return token

    def _push(self, job: _Job, token: str) -> PushResult:
        if job.storage_uri is None:
            raise StorageError(f"checkpoint {job.tinker_path} was deleted before it could be pushed")
        if self._scratch_dir is not None:
            self._scratch_dir.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix=f"hub-push-{job.push_id}-", dir=self._scratch_dir))
        try:
            source = self._materialise(job.storage_uri)
            facts = CardFacts(job.base_model, job.rank, job.training_run_id, job.tinker_path, read_steps(source))
            files = build_upload_folder(source, scratch / "upload", facts)
            message = job.commit_message or f"Upload LoRA adapter {job.tinker_path} (Carpool)"
            request = PushRequest(job.repo, scratch / "upload", token, job.private, job.revision, message,
                                  f"carpool-push: {job.push_id}", files)
            return self._clients[job.target].push(request)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def _materialise(self, uri: str) -> Path:
        fetch = getattr(self._store, "fetch", None)
        if self._store.remote and callable(fetch):
            return Path(fetch(uri))
        path = self._store.local_path(uri)
        if not path.is_dir():
            raise StorageError(f"the files of {uri} are gone")
        return path

    def _fail(self, job: _Job, message: str) -> Finished:
        with self._db.sessions.begin() as db:
            finish_hub_push(db, job.push_id, "failed", error=message)
        log.warning("hub push %s failed: %s", job.push_id, message)
        self._on_finished(job.target, "failed")
        return Finished("failed")

    def fail_exhausted(self, push_id: int, error: str) -> None:
        """Mark a push failed whose task gave up outside `run` (e.g. the worker lost it too often)."""
        with self._db.sessions.begin() as db:
            finish_hub_push(db, HubPushId(push_id), "failed", error=error)


def _redact(text: str, token: str | None) -> str:
    return text.replace(token, "***") if token else text
