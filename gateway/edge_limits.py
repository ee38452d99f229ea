"""Per-caller limits at the HTTP edge, applied before any route runs, and the bounded decode pool.

`EdgeLimiter` answers 429 (with `Retry-After` / `retry-after-ms`, which the SDK honours) before the app
sees a request when its caller
- has `max_in_flight` requests open already (long-polls included),
- is over `rate_per_s` requests per second (a token bucket of `burst` requests), or
- comes from an address whose recent requests failed authentication `failed_auth_burst` times (refilled
  at `failed_auth_per_minute`); requests with a key that authenticated recently are never held by this.

A caller is its presented credential (a SHA-256 digest of the key, never the key itself), else its client
address. The limits are per gateway process (several gateways behind a balancer multiply them); the
quotas of `services.control.quotas` are the cluster-wide ones. `body_limit` picks the body cap of a path:
only the bulk-data routes take `max_body_bytes`, the rest `max_small_body_bytes`.

`DecodePool` runs CPU-heavy body decoding on a fixed number of threads of its own, so a burst of large
bodies queues there instead of occupying the default executor that database transactions use.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from starlette.types import Scope

_T = TypeVar("_T")

BULK_PATHS = frozenset({"/api/v1/forward_backward", "/api/v1/forward", "/api/v1/asample", "/api/v1/sample"})
"""Routes whose bodies carry training or sampling data (everything else is small JSON)."""
_TRACKED_CALLERS = 50_000
"""Most callers (credentials / addresses) whose buckets are kept; the least recently seen are dropped."""


@dataclass(frozen=True)
class EdgeLimitOptions:
    """The knobs of `EdgeLimiter` (None switches a limit off)."""

    max_in_flight: int | None = 2048
    rate_per_s: float | None = 500.0
    burst: int = 2000
    failed_auth_per_minute: float | None = 30.0
    failed_auth_burst: int = 30
    max_small_body_bytes: int = 1024 * 1024


@dataclass
class _Bucket:
    level: float
    at: float

    def take(self, rate: float, capacity: float, now: float) -> float:
        """Take one token; 0.0 when taken, else the seconds until one is there (nothing taken)."""
        self.level = min(capacity, self.level + (now - self.at) * rate)
        self.at = now
        if self.level >= 1.0:
            self.level -= 1.0
            return 0.0
        return (1.0 - self.level) / rate

    def peek(self, rate: float, capacity: float, now: float) -> float:
        level = min(capacity, self.level + (now - self.at) * rate)
        return 0.0 if level >= 1.0 else (1.0 - level) / rate


class _Lru(OrderedDict[str, _Bucket]):
    def touch(self, key: str, make: Callable[[], _Bucket]) -> _Bucket:
        bucket = self.get(key)
        if bucket is None:
            bucket = self[key] = make()
            if len(self) > _TRACKED_CALLERS:
                self.popitem(last=False)
        else:
            self.move_to_end(key)
        return bucket


@dataclass(frozen=True)
class Refusal:
    """Why the edge refused a request, and when to come back."""

    detail: str
    retry_after_s: float


class EdgeLimiter:
    """See the module docstring. Single event loop: no locking."""

    def __init__(self, options: EdgeLimitOptions | None = None, clock: Callable[[], float] = time.monotonic):
        self.options = options or EdgeLimitOptions()
        self._clock = clock
        self._in_flight: dict[str, int] = {}
        self._rates = _Lru()
        self._failures = _Lru()
        self._good = _Lru()
        """Credential digests that authenticated recently (their requests skip the failed-auth check)."""

    def admit(self, caller: Caller) -> Refusal | None:
        """Count the request in (call `release` when it ends) or say why it is refused."""
        opts, now = self.options, self._clock()
        if caller.credential is None or caller.key not in self._good:
            refusal = self._failed_auth_refusal(caller, now)
            if refusal is not None:
                return refusal
        if opts.max_in_flight is not None and self._in_flight.get(caller.key, 0) >= opts.max_in_flight:
            return Refusal(f"too many requests in flight for this API key (limit {opts.max_in_flight}, "
                           "setting edge_max_in_flight); wait for some to finish", 1.0)
        if opts.rate_per_s is not None:
            bucket = self._rates.touch(caller.key, lambda: _Bucket(float(opts.burst), now))
            wait = bucket.take(opts.rate_per_s, float(opts.burst), now)
            if wait > 0:
                return Refusal(f"over {opts.rate_per_s:g} requests per second for this API key (setting "
                               "edge_rate_per_second)", wait)
        self._in_flight[caller.key] = self._in_flight.get(caller.key, 0) + 1
        return None

    def release(self, caller: Caller, status: int) -> None:
        """The request ended with `status`: free its slot and learn from an authentication failure."""
        left = self._in_flight.get(caller.key, 1) - 1
        if left > 0:
            self._in_flight[caller.key] = left
        else:
            self._in_flight.pop(caller.key, None)
        if status == 401:
            self._good.pop(caller.key, None)
            self._record_failure(caller.address)
        elif caller.credential is not None and status < 400:
            self._good.touch(caller.key, lambda: _Bucket(0.0, 0.0))

    def _failed_auth_refusal(self, caller: Caller, now: float) -> Refusal | None:
        rate = self.options.failed_auth_per_minute
        bucket = self._failures.get(caller.address)
        if rate is None or bucket is None:
            return None
        wait = bucket.peek(rate / 60.0, float(self.options.failed_auth_burst), now)
        if wait <= 0:
            return None
        return Refusal(f"too many failed authentications from this address (limit "
                       f"{self.options.failed_auth_burst}, refilled at {rate:g} per minute; setting "
                       "edge_failed_auth_per_minute)", wait)

    def _record_failure(self, address: str) -> None:
        rate = self.options.failed_auth_per_minute
        if rate is None:
            return
        now, burst = self._clock(), float(self.options.failed_auth_burst)
        self._failures.touch(address, lambda: _Bucket(burst, now)).take(rate / 60.0, burst, now)

    def body_limit(self, path: str, max_body_bytes: int) -> int:
        """The body cap of `path`: bulk-data routes get `max_body_bytes`, the others the small cap."""
        return max_body_bytes if path in BULK_PATHS else min(max_body_bytes, self.options.max_small_body_bytes)


@dataclass(frozen=True)
class Caller:
    """Who a request counts against: `key` (credential digest, else address) and its client address."""

    key: str
    address: str
    credential: str | None


def caller_of(scope: Scope) -> Caller:
    """The caller of an HTTP scope; the key's digest stands in for the key (never kept or logged)."""
    client = scope.get("client")
    address = str(client[0]) if client else "unknown"
    presented = None
    for name, value in scope.get("headers", ()):
        if name == b"x-api-key" or (name == b"authorization" and value[:7].lower() == b"bearer "):
            presented = value[7:] if name == b"authorization" else value
            break
    if not presented or not presented.strip():
        return Caller(f"addr:{address}", address, None)
    digest = hashlib.sha256(presented.strip()).hexdigest()[:32]
    return Caller(f"key:{digest}", address, digest)


class DecodePool:
    """A fixed number of threads for decoding request bodies (see the module docstring)."""

    def __init__(self, threads: int) -> None:
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="carpool-decode")

    async def run(self, fn: Callable[[], _T]) -> _T:
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
