"""Tenant quotas at the edge (models, tokens per minute, concurrent requests) and the capacity signal.

Limits come from the tenant row (`TenantQuotas`, set with `carpool tenants set-quota`), falling back to
server-wide defaults. A submission over a limit raises `QuotaExceeded` with the seconds until it would
pass; the gateway answers 429 with `Retry-After` / `retry-after-ms`, which the SDK honours (≤ 60 s)
while it retries the *same* request:

- `max_models`: active training runs; checked when a model is created.
- `max_concurrent_requests`: queued + running requests in the request log. A training request that fills
  a gap below a later queued request of its model, with no earlier request of the model unfinished, is
  exempt: the later one cannot run without it, so refusing it would deadlock the model until the SDK gives
  up. At most one such request per model is exempt at a time.
- `tokens_per_minute`: a token bucket per tenant (capacity = the limit, refilled evenly over
  `token_window_s`), charged with a request's tokens when it is accepted. A request that could never
  fit the bucket is `Invalid` (400) instead. The bucket lives in a `QuotaStore`
  (services/control/quota_store.py): `InProcessQuotaStore` for one process (embedded mode), `RedisQuotaStore`
  (a Lua script, Redis's clock) when several gateway processes share the limits (cluster mode).

Training requests are refused *before* their seq id is reserved, so the SDK's retry of the same seq id
is accepted later. If the SDK gives up instead (its retries end after about five minutes) it moves on to
the next seq id; the gap would block the model forever. So every refusal leaves a marker that expires
a retry interval later, and a timer consumes the seq id (`reject_seq_id`) once the marker is gone and
the seq id is still unused: no retry has come for longer than the SDK ever waits between two.

`capacity_state` answers the `queue_state` of a pending future: `paused_capacity` while its request is
still queued (not running) and the base model is saturated (backlog or the request's own wait over the
thresholds), else `active`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import ControlError, Invalid, QuotaExceeded
from services.control.quota_standing import QuotaStanding, bucket_key, read_standing, remember_refusal
from services.control.quota_store import InProcessQuotaStore, QuotaStore
from services.db.checkpoints import checkpoint_storage_bytes
from services.db.ids import ModelId, TenantId
from services.db.models import CheckpointRow, RequestRow, SamplingSessionRow, SessionRow
from services.db.request_log import UNFINISHED, count_unfinished_requests
from services.db.runs import count_active_training_runs

log = logging.getLogger(__name__)

QueueStateName = Literal["active", "paused_capacity", "paused_rate_limit"]
SDK_MAX_RETRY_AFTER_S = 60.0
"""The SDK honours `Retry-After` only up to this; longer hints fall back to its own backoff (≤ 30 s)."""
ABANDONED_ERROR = ("this request was refused over a quota and not retried in time; the client moved on, so its "
                   "seq_id was consumed")
ConsumeSeqId = Callable[[Tenant, ModelId, int, str], Awaitable[None]]


@dataclass(frozen=True)
class QuotaOptions:
    """Server-wide quota defaults and timings (a tenant's own limits win over the defaults)."""

    default_tokens_per_minute: int | None = None
    default_max_concurrent_requests: int | None = None
    token_window_s: float = 60.0
    """The `tokens_per_minute` window: the bucket refills its full capacity over this long (tests shorten it)."""
    models_retry_after_s: float = 60.0
    """Retry hint when the model limit is reached (nothing tells when the tenant will free a model)."""
    concurrency_retry_after_s: float = 1.0
    """Retry hint when too many requests are unfinished (short: requests usually finish within seconds)."""
    sdk_retry_gap_s: float = 30.0
    """Longest the SDK waits between two tries of a refused request when the hint is shorter (the cap of its
    holder-level backoff)."""
    abandon_grace_s: float = 60.0
    """Added to the longest retry gap before a refused seq id counts as abandoned (slow links, busy clients)."""
    saturation_queue_depth: int | None = 256
    """Requests queued for one base model from which pending futures report `paused_capacity`."""
    saturation_wait_s: float | None = 30.0
    """A request queued (not running) this long reports `paused_capacity`."""
    default_max_checkpoints: int | None = None
    """Stored checkpoints per tenant without a `max_checkpoints` of its own (None: unlimited)."""
    default_max_checkpoint_bytes: int | None = None
    """Recorded checkpoint bytes per tenant without a `max_checkpoint_bytes` of its own."""
    default_max_sessions: int | None = None
    """Unfinished sessions per tenant without a `max_sessions` of its own."""
    default_max_sampling_sessions: int | None = None
    """Sampling sessions (of unfinished sessions) per tenant without a `max_sampling_sessions` of its own."""
    holdings_retry_after_s: float = 60.0
    """Retry hint when a session limit is reached (sessions end, or go stale and are swept)."""


class QuotaGate:
    """The quota checks the control plane runs on new submissions (never on retries of logged ones)."""

    def __init__(self, options: QuotaOptions | None = None, store: QuotaStore | None = None, *,
                 default_max_models: int | None = None) -> None:
        self.options = options or QuotaOptions()
        self.store: QuotaStore = store or InProcessQuotaStore()
        self._default_max_models = default_max_models
        self._reaper = _AbandonedSeqReaper(self.store, self.options)

    def check_models(self, db: Session, tenant: Tenant) -> None:
        """Before creating a model: `QuotaExceeded` if the tenant holds its limit of active models."""
        limit = _first_set(tenant.quotas.max_models, self._default_max_models)
        if limit is None:
            return
        active = count_active_training_runs(db, TenantId(tenant.id))
        if active >= limit:
            raise self._refuse(tenant, "max_models", QuotaExceeded(
                f"tenant {tenant.name} already has {active} models, its limit is {limit}; unload one first",
                retry_after_s=self.options.models_retry_after_s))

    def concurrency_limit(self, tenant: Tenant) -> int | None:
        """`max_concurrent_requests` in force for the tenant (None: unlimited)."""
        return _first_set(tenant.quotas.max_concurrent_requests, self.options.default_max_concurrent_requests)

    def check_concurrency(self, db: Session, tenant: Tenant, *, model_id: ModelId | None = None,
                          seq_id: int | None = None, unfinished: int | None = None) -> None:
        """Before logging a request: `QuotaExceeded` if the tenant has its limit of unfinished requests.

        `unfinished`: the count, when the caller read it already in this transaction (`submission_facts`).
        """
        limit = self.concurrency_limit(tenant)
        if limit is None:
            return
        if unfinished is None:
            unfinished = count_unfinished_requests(db, TenantId(tenant.id))
        if unfinished < limit:
            return  # the common case: one statement (the gap is looked for only when it could matter)
        if model_id is not None and seq_id is not None and _fills_a_gap(db, model_id, seq_id):
            return
        raise self._refuse(tenant, "max_concurrent_requests", QuotaExceeded(
            f"tenant {tenant.name} has {unfinished} unfinished requests, its limit is {limit}",
            retry_after_s=self.options.concurrency_retry_after_s))

    def check_storage(self, db: Session, tenant: Tenant, *, replacing: bool = False) -> None:
        """Before a named save: `Invalid` (400) when the tenant's stored checkpoints reach a limit.

        Not a 429: only deleting checkpoints (or their TTL passing) frees space, so retrying cannot help.
        `replacing`: an overwrite of an existing checkpoint adds no checkpoint (bytes are still checked).
        """
        tenant_id = TenantId(tenant.id)
        limits = self.storage_limits(tenant)
        count_limit = limits["max_checkpoints"]
        if count_limit is not None and not replacing:
            stored = count_tenant_checkpoints(db, tenant_id)
            if stored >= count_limit:
                raise self._refuse(tenant, "max_checkpoints", Invalid(
                    f"tenant {tenant.name} stores {stored} checkpoints, its limit (max_checkpoints) is "
                    f"{count_limit}; delete some or let their TTL expire", field="max_checkpoints"))
        bytes_limit = limits["max_checkpoint_bytes"]
        if bytes_limit is not None:
            used = checkpoint_storage_bytes(db, tenant_id)
            if used >= bytes_limit:
                raise self._refuse(tenant, "max_checkpoint_bytes", Invalid(
                    f"tenant {tenant.name} stores {used} bytes of checkpoints, its limit (max_checkpoint_bytes) "
                    f"is {bytes_limit}; delete some or let their TTL expire", field="max_checkpoint_bytes"))

    def storage_limits(self, tenant: Tenant) -> dict[str, int | None]:
        """`max_checkpoints` / `max_checkpoint_bytes` in force for the tenant (None: unlimited)."""
        opts = self.options
        return {"max_checkpoints": _first_set(tenant.quotas.max_checkpoints, opts.default_max_checkpoints),
                "max_checkpoint_bytes": _first_set(tenant.quotas.max_checkpoint_bytes,
                                                   opts.default_max_checkpoint_bytes)}

    def check_sessions(self, db: Session, tenant: Tenant) -> None:
        """Before creating a session: `QuotaExceeded` at the tenant's limit of unfinished sessions."""
        limit = _first_set(tenant.quotas.max_sessions, self.options.default_max_sessions)
        if limit is not None and (live := count_live_sessions(db, TenantId(tenant.id))) >= limit:
            raise self._refuse(tenant, "max_sessions", QuotaExceeded(
                f"tenant {tenant.name} has {live} unfinished sessions, its limit (max_sessions) is {limit}",
                retry_after_s=self.options.holdings_retry_after_s))

    def check_sampling_sessions(self, db: Session, tenant: Tenant) -> None:
        """Before creating a sampling session: `QuotaExceeded` at the tenant's limit."""
        limit = _first_set(tenant.quotas.max_sampling_sessions, self.options.default_max_sampling_sessions)
        if limit is not None and (live := count_live_sampling_sessions(db, TenantId(tenant.id))) >= limit:
            raise self._refuse(tenant, "max_sampling_sessions", QuotaExceeded(
                f"tenant {tenant.name} has {live} sampling sessions, its limit (max_sampling_sessions) is {limit}",
                retry_after_s=self.options.holdings_retry_after_s))

    def charge_tokens(self, tenant: Tenant, tokens: int) -> None:
        """Take an accepted request's tokens from the tenant's bucket, or refuse it."""
        limit = _first_set(tenant.quotas.tokens_per_minute, self.options.default_tokens_per_minute)
        if limit is None or tokens <= 0:
            return
        if tokens > limit:
            raise Invalid(f"the request holds {tokens} tokens, more than tenant {tenant.name}'s limit of {limit} "
                          f"tokens per minute; send smaller batches", field="data")
        wait_s = self.store.take(bucket_key(tenant.id), tokens, limit, self.options.token_window_s)
        if wait_s > 0:
            raise self._refuse(tenant, "tokens_per_minute", QuotaExceeded(
                f"tenant {tenant.name} is over its limit of {limit} tokens per minute; this request's {tokens} "
                f"tokens fit in {wait_s:.1f} s", retry_after_s=wait_s))

    def standing(self, tenant: Tenant) -> QuotaStanding:
        """The tenant's token bucket and last refusal, read (never taken) from this gate's store."""
        limit = _first_set(tenant.quotas.tokens_per_minute, self.options.default_tokens_per_minute)
        return read_standing(self.store, tenant.id, limit, self.options.token_window_s)

    def _refuse(self, tenant: Tenant, quota: str, error: ControlError) -> ControlError:
        """Remember the refusal for the operators' "why refused" view, then hand `error` back to be raised."""
        wait = error.retry_after_s if isinstance(error, QuotaExceeded) else None
        remember_refusal(self.store, tenant.id, quota, error.message, wait, datetime.now(UTC))
        return error

    def refused(self, tenant: Tenant, model_id: ModelId, seq_id: int, retry_after_s: float,
                consume: ConsumeSeqId) -> None:
        """A training request was refused before its seq id was reserved: watch for its abandonment."""
        self._reaper.watch(tenant, model_id, seq_id, retry_after_s, consume)

    def capacity_state(self, *, queued_for_s: float | None, backlog: int | None) -> QueueStateName:
        """`paused_capacity` for a still-queued request on a saturated base model, else `active`.

        `queued_for_s` is None once the request runs; `backlog` is the model's queued requests (if known).
        """
        if queued_for_s is None:
            return "active"
        wait_limit, depth_limit = self.options.saturation_wait_s, self.options.saturation_queue_depth
        if wait_limit is not None and queued_for_s >= wait_limit:
            return "paused_capacity"
        if depth_limit is not None and backlog is not None and backlog >= depth_limit:
            return "paused_capacity"
        return "active"


def queued_seconds(status: str, created_at: datetime, now: datetime) -> float | None:
    """How long a request has waited without running (None once it runs or ended)."""
    return max(0.0, (now - created_at).total_seconds()) if status == "queued" else None


class _AbandonedSeqReaper:
    """Consumes seq ids whose refused submissions stopped being retried (see the module docstring)."""

    def __init__(self, store: QuotaStore, options: QuotaOptions) -> None:
        self._store = store
        self._options = options
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._tasks: set[asyncio.Task[None]] = set()

    def watch(self, tenant: Tenant, model_id: ModelId, seq_id: int, retry_after_s: float,
              consume: ConsumeSeqId) -> None:
        # The next retry comes within the hint (honoured up to 60 s) or the SDK's own backoff (≤ 30 s).
        gap_s = min(max(retry_after_s, self._options.sdk_retry_gap_s), SDK_MAX_RETRY_AFTER_S)
        horizon_s = gap_s + self._options.abandon_grace_s
        key = f"refused:{model_id}:{seq_id}"
        self._store.mark(key, horizon_s)
        loop = asyncio.get_running_loop()
        previous = self._timers.pop(key, None)
        if previous is not None:
            previous.cancel()
        # Fire a little after the marker expires: only then is "no retry within the horizon" established.
        self._timers[key] = loop.call_later(horizon_s * 1.1, self._fire, key, tenant, model_id, seq_id, consume)

    def _fire(self, key: str, tenant: Tenant, model_id: ModelId, seq_id: int, consume: ConsumeSeqId) -> None:
        self._timers.pop(key, None)
        task = asyncio.ensure_future(self._reap(key, tenant, model_id, seq_id, consume))
        self._tasks.add(task)  # keep a reference until done (the loop holds tasks only weakly)
        task.add_done_callback(self._tasks.discard)

    async def _reap(self, key: str, tenant: Tenant, model_id: ModelId, seq_id: int, consume: ConsumeSeqId) -> None:
        try:
            if await asyncio.to_thread(self._store.marked, key):
                return  # retried since (perhaps on another gateway process): that refusal watches it now
            # A no-op when the seq id was accepted meanwhile: consuming finds its request and stops there.
            await consume(tenant, model_id, seq_id, ABANDONED_ERROR)
            log.info("seq_id %d of model %s: no retry since its quota refusal; consumed unless accepted meanwhile",
                     seq_id, model_id)
        except ControlError as exc:  # e.g. the model was deleted since: nothing left to unblock
            log.debug("seq_id %d of model %s not consumed: %s", seq_id, model_id, exc.message)
        except Exception:  # noqa: BLE001 - a timer callback has no caller to report to
            log.exception("could not consume abandoned seq_id %d of model %s", seq_id, model_id)


def count_tenant_checkpoints(db: Session, tenant_id: TenantId) -> int:
    return int(db.scalar(select(func.count()).select_from(CheckpointRow).where(CheckpointRow.tenant_id == tenant_id))
               or 0)


def count_live_sessions(db: Session, tenant_id: TenantId) -> int:
    stmt = select(func.count()).select_from(SessionRow).where(SessionRow.tenant_id == tenant_id,
                                                              SessionRow.finished_at.is_(None))
    return int(db.scalar(stmt) or 0)


def count_live_sampling_sessions(db: Session, tenant_id: TenantId) -> int:
    stmt = (select(func.count()).select_from(SamplingSessionRow)
            .join(SessionRow, SessionRow.id == SamplingSessionRow.session_id)
            .where(SamplingSessionRow.tenant_id == tenant_id, SessionRow.finished_at.is_(None)))
    return int(db.scalar(stmt) or 0)


def _first_set(*values: int | None) -> int | None:
    return next((v for v in values if v is not None), None)


def _fills_a_gap(db: Session, model_id: ModelId, seq_id: int) -> bool:
    """Whether this request is what its model waits for: a later request of the model is unfinished, and
    no earlier one is (the model's next runnable seq id is this one, so refusing it would stall the model).

    Requiring that no earlier request is unfinished keeps the exemption to one request per model at a time:
    sending a huge seq id first no longer exempts every lower one (they queue one by one behind it).
    """
    unfinished = select(RequestRow.id).where(RequestRow.model_id == model_id, RequestRow.status.in_(UNFINISHED))
    later = db.scalars(unfinished.where(RequestRow.seq_id > seq_id).limit(1)).first()
    if later is None:
        return False
    earlier = db.scalars(unfinished.where(RequestRow.seq_id < seq_id).limit(1)).first()
    return earlier is None
