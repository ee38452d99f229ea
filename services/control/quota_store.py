"""Where the quotas keep their shared state: token buckets, expiring markers and notes (`QuotaStore`).

`InProcessQuotaStore` keeps them in this process's memory (embedded mode: one gateway process);
`RedisQuotaStore` on Redis, with Lua scripts on Redis's own clock, so every gateway process of a cluster sees
the same buckets and the same time. `services/control/quotas.py` decides what to take and when to refuse.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any, Protocol


class QuotaStore(Protocol):
    """Shared state of the quotas: token buckets and expiring markers. Thread-safe; called off the loop."""

    def take(self, key: str, amount: int, capacity: int, window_s: float) -> float:
        """Take `amount` from `key`'s bucket (full = `capacity`, refilled evenly over `window_s`).

        Returns 0.0 when taken; otherwise takes nothing and returns the seconds until `amount` is there.
        """
        ...

    def mark(self, key: str, ttl_s: float) -> None:
        """Set (or renew) a marker that disappears after `ttl_s`."""
        ...

    def marked(self, key: str) -> bool: ...

    def level(self, key: str, capacity: int, window_s: float) -> float:
        """Tokens in `key`'s bucket now (full when unknown), as `take` would see them; changes nothing."""
        ...

    def note(self, key: str, text: str, ttl_s: float) -> None:
        """Keep `text` under `key` for `ttl_s` (what refused a tenant last, for the operators' view)."""
        ...

    def noted(self, key: str) -> str | None: ...


class InProcessQuotaStore:
    """`QuotaStore` in this process's memory (embedded mode: one gateway process)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._buckets: dict[str, tuple[float, float]] = {}
        """key → (tokens, time of that level)."""
        self._markers: dict[str, float] = {}
        """key → expiry."""
        self._notes: dict[str, tuple[str, float]] = {}
        """key → (text, expiry)."""

    def take(self, key: str, amount: int, capacity: int, window_s: float) -> float:
        rate = capacity / window_s
        with self._lock:
            now = self._clock()
            level, since = self._buckets.get(key, (float(capacity), now))
            level = min(float(capacity), level + max(0.0, now - since) * rate)
            if level >= amount:
                self._buckets[key] = (level - amount, now)
                return 0.0
            self._buckets[key] = (level, now)
            return (amount - level) / rate

    def mark(self, key: str, ttl_s: float) -> None:
        with self._lock:
            now = self._clock()
            self._markers = {k: t for k, t in self._markers.items() if t > now}  # bounded by live refusals
            self._markers[key] = now + ttl_s

    def marked(self, key: str) -> bool:
        with self._lock:
            return self._markers.get(key, float("-inf")) > self._clock()

    def level(self, key: str, capacity: int, window_s: float) -> float:
        with self._lock:
            now = self._clock()
            level, since = self._buckets.get(key, (float(capacity), now))
        return min(float(capacity), level + max(0.0, now - since) * capacity / window_s)

    def note(self, key: str, text: str, ttl_s: float) -> None:
        with self._lock:
            now = self._clock()
            self._notes = {k: v for k, v in self._notes.items() if v[1] > now}  # one per recently refused tenant
            self._notes[key] = (text, now + ttl_s)

    def noted(self, key: str) -> str | None:
        with self._lock:
            text, expiry = self._notes.get(key, ("", float("-inf")))
            return text if expiry > self._clock() else None


# A token bucket kept as a hash {level, ts}; Redis's own clock, so every gateway process agrees on time.
# Returns a string: Redis would truncate a Lua number to an integer.
_TAKE_SCRIPT = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1000000
local capacity = tonumber(ARGV[1])
local rate = tonumber(ARGV[2])
local amount = tonumber(ARGV[3])
local state = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(state[1]) or capacity
local since = tonumber(state[2]) or now
level = math.min(capacity, level + math.max(0, now - since) * rate)
local wait = 0
if level >= amount then level = level - amount else wait = (amount - level) / rate end
redis.call('HSET', KEYS[1], 'level', tostring(level), 'ts', tostring(now))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return tostring(wait)
"""

# The same level `_TAKE_SCRIPT` computes, on the same clock, without writing anything (the admin view).
_LEVEL_SCRIPT = """
local now_parts = redis.call('TIME')
local now = tonumber(now_parts[1]) + tonumber(now_parts[2]) / 1000000
local capacity = tonumber(ARGV[1])
local state = redis.call('HMGET', KEYS[1], 'level', 'ts')
local level = tonumber(state[1]) or capacity
local since = tonumber(state[2]) or now
return tostring(math.min(capacity, level + math.max(0, now - since) * tonumber(ARGV[2])))
"""


class RedisQuotaStore:
    """`QuotaStore` on Redis, shared by every gateway process (cluster mode).

    `client` is a `redis.Redis`; keys live under `{prefix}:quota:`. A bucket expires once it would be full
    again, so idle tenants cost nothing.
    """

    def __init__(self, client: Any, *, prefix: str = "carpool") -> None:
        self._client = client
        self._prefix = f"{prefix}:quota"
        self._take = client.register_script(_TAKE_SCRIPT)
        self._level = client.register_script(_LEVEL_SCRIPT)

    def take(self, key: str, amount: int, capacity: int, window_s: float) -> float:
        ttl_ms = int(window_s * 1000) + 1000
        wait = self._take(keys=[f"{self._prefix}:bucket:{key}"], args=[capacity, capacity / window_s, amount, ttl_ms])
        return float(wait.decode() if isinstance(wait, bytes) else wait)

    def mark(self, key: str, ttl_s: float) -> None:
        self._client.set(f"{self._prefix}:mark:{key}", b"1", px=max(1, int(ttl_s * 1000)))

    def marked(self, key: str) -> bool:
        return bool(self._client.exists(f"{self._prefix}:mark:{key}"))

    def level(self, key: str, capacity: int, window_s: float) -> float:
        level = self._level(keys=[f"{self._prefix}:bucket:{key}"], args=[capacity, capacity / window_s])
        return float(level.decode() if isinstance(level, bytes) else level)

    def note(self, key: str, text: str, ttl_s: float) -> None:
        self._client.set(f"{self._prefix}:note:{key}", text.encode(), px=max(1, int(ttl_s * 1000)))

    def noted(self, key: str) -> str | None:
        raw = self._client.get(f"{self._prefix}:note:{key}")
        return None if raw is None else (raw.decode() if isinstance(raw, bytes) else str(raw))
