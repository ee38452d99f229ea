"""A tenant's standing against its quotas, read from the counters the limiter itself enforces.

The admin dashboard's "why refused" view asks two things the request log cannot answer, because a refused
request never reaches it: how full the tenant's tokens-per-minute bucket is now (and when it is full
again), and which quota refused its last request and when that quota lets it through. Both live in the
gate's `QuotaStore` — in process memory in embedded mode, on Redis (its clock) in cluster mode — so every
gateway process reports the same numbers the next `take` would act on:

- the bucket level through `QuotaStore.level`, a read that never moves the bucket;
- the last refusal as a short JSON note (`remember_refusal`, written by `QuotaGate` where it refuses),
  kept for `REFUSAL_MEMORY_S`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from services.control.quota_store import QuotaStore

REFUSAL_MEMORY_S = 24 * 3600.0
"""How long the last refusal of a tenant is remembered for the operators' view."""
MESSAGE_MAX_CHARS = 300


@dataclass(frozen=True)
class TokenBucket:
    """The tenant's tokens-per-minute bucket as the limiter sees it now."""

    limit: int
    """Capacity: the tenant's `tokens_per_minute` (or the server default)."""
    level: float
    window_s: float
    """The bucket refills its whole capacity evenly over this long."""

    @property
    def full_in_s(self) -> float:
        """Seconds until the bucket is full again (0 when it is)."""
        return max(0.0, (self.limit - self.level) * self.window_s / self.limit)


@dataclass(frozen=True)
class Refusal:
    """The last request a quota refused: which quota, its message, when, and when it lets requests in."""

    quota: str
    message: str
    at: datetime
    resets_at: datetime | None
    """None for quotas no waiting frees (storage: only deleting checkpoints does)."""


@dataclass(frozen=True)
class QuotaStanding:
    tokens: TokenBucket | None
    """None when the tenant has no tokens-per-minute limit."""
    last_refusal: Refusal | None


def bucket_key(tenant_id: str) -> str:
    """The tokens-per-minute bucket of a tenant (the key `QuotaGate.charge_tokens` takes from)."""
    return f"tpm:{tenant_id}"


def _refusal_key(tenant_id: str) -> str:
    return f"refusal:{tenant_id}"


def remember_refusal(store: QuotaStore, tenant_id: str, quota: str, message: str, retry_after_s: float | None,
                     now: datetime) -> None:
    """Record that `quota` refused the tenant's request at `now` (it passes again after `retry_after_s`)."""
    record = {"quota": quota, "message": message[:MESSAGE_MAX_CHARS], "at": now.timestamp(),
              "retry_after_s": retry_after_s}
    store.note(_refusal_key(tenant_id), json.dumps(record), REFUSAL_MEMORY_S)


def read_standing(store: QuotaStore, tenant_id: str, tokens_per_minute: int | None,
                  window_s: float) -> QuotaStanding:
    """The tenant's bucket (if it has a limit) and its last remembered refusal."""
    tokens = None
    if tokens_per_minute is not None and tokens_per_minute > 0:
        level = store.level(bucket_key(tenant_id), tokens_per_minute, window_s)
        tokens = TokenBucket(tokens_per_minute, level, window_s)
    return QuotaStanding(tokens, _refusal(store.noted(_refusal_key(tenant_id))))


def _refusal(raw: str | None) -> Refusal | None:
    if raw is None:
        return None
    try:
        record = json.loads(raw)
        at = datetime.fromtimestamp(float(record["at"]), UTC)
        wait = record.get("retry_after_s")
        resets = None if wait is None else at + timedelta(seconds=float(wait))
        return Refusal(str(record["quota"]), str(record.get("message", "")), at, resets)
    except (ValueError, KeyError, TypeError):  # a note written by another version: show nothing, not a 500
        return None
