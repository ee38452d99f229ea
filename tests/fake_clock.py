"""A clock for code that takes one (`clock: Callable[[], float]`): frozen unless a test moves it, so the times
a test asserts (a Retry-After, a bucket's level, a cache entry's expiry) are exact, not ± jitter."""

from __future__ import annotations


class FakeClock:
    """Monotonic seconds that only change when a test sets or advances `now`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now
