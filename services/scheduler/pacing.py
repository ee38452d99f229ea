"""Pass pacing: how long passes take, and how many tokens a contended pass may hold.

`PassCostModel` fits a pass's duration as fixed + per-token cost from the passes the scheduler ran;
`PassPacer` turns that fit into a token budget while two or more tenants contend, so that a pass takes about
`latency_factor` times what the smallest contending tenant's work would take alone (or an explicit
`max_pass_seconds`). Pure: durations are handed in by the scheduler; no clock, no I/O.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections import deque
from collections.abc import Sequence

DEFAULT_PASS_LATENCY_FACTOR = 1.5
"""A latency multiple, not a machine constant. A light request that arrives just after a pass started waits it
out and rides in the next, so its worst-case wait is about 2x this factor times its own pass; one arriving at
a random point waits about 1.5x. Chosen with bench/fairness.py (docs/performance.md, "Fairness"): 1.5 kept
the light tenant's median wait at 1.3-1.6x its wait alone; 4/3 at 1.2-1.3x, but with 21-25 % less
throughput for the heavy tenant."""


class PassCostModel:
    """A pass's duration as `fixed + per_token * tokens`, fitted to the last `window` passes.

    Robust rather than least squares, because a shared machine now and then stalls a pass for many times its
    usual time: the per-token cost is the median of the slopes between pairs of recent passes whose sizes
    differ by at least `min_spread` (Theil-Sen, each pair weighted by how far apart its sizes are), the fixed
    cost the median of what each pass took beyond its tokens. The first pass is not used (it pays for
    warm-up). Fixed and per-token cost can only be told apart from passes of different sizes: until
    `min_pairs` such pairs were seen there is no fit, and while recent passes are all alike the last slope is
    kept (the fixed cost still follows, so a machine that gets slower still shows).
    """

    def __init__(self, window: int = 24, min_spread: float = 0.25, min_pairs: int = 8) -> None:
        if window < 2:
            raise ValueError(f"window must be >= 2, got {window}")
        self._passes: deque[tuple[int, float]] = deque(maxlen=window)
        self._min_spread = min_spread
        self._min_pairs = min_pairs
        self._warm = False
        self._slope: float | None = None
        self._cost: tuple[float, float] | None = None

    def observe(self, tokens: int, seconds: float) -> None:
        """A pass of `tokens` took `seconds`."""
        if tokens <= 0 or seconds <= 0:
            return
        if not self._warm:
            self._warm = True
            return
        self._passes.append((tokens, seconds))
        slope = self._pairwise_slope()
        if slope is not None:
            self._slope = slope
        if self._slope is not None:
            # A line through the origin at the most: a negative fixed cost is noise in the slope.
            self._cost = max(0.0, statistics.median(t - self._slope * n for n, t in self._passes)), self._slope

    def _pairwise_slope(self) -> float | None:
        pairs = [((t2 - t1) / (n2 - n1), abs(n2 - n1))
                 for (n1, t1), (n2, t2) in itertools.combinations(self._passes, 2)
                 if abs(n2 - n1) >= self._min_spread * max(n1, n2)]
        if len(pairs) < self._min_pairs:
            return None
        # Noise can make the slope negative; time does not fall with tokens, so clamp it.
        return max(0.0, _weighted_median(pairs))

    def cost(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token); None until passes of different sizes were seen."""
        return self._cost

    def estimate(self, tokens: int) -> float | None:
        """Seconds a pass of `tokens` should take; None without a fit."""
        cost = self._cost
        return None if cost is None else cost[0] + cost[1] * tokens

    def typical_tokens(self) -> int | None:
        """The median size of recent passes; None before any."""
        return int(statistics.median(n for n, _ in self._passes)) if self._passes else None


def _weighted_median(values: Sequence[tuple[float, float]]) -> float:
    """The median of (value, weight) pairs: pairs of passes far apart in size tell the slope best."""
    ordered = sorted(values)
    half, running = sum(w for _, w in ordered) / 2, 0.0
    for value, weight in ordered:
        running += weight
        if running >= half:
            return value
    return ordered[-1][0]


class PassPacer:
    """Turns contention into a per-pass token budget: the most tokens whose estimated pass fits the target.

    The target is `max_pass_seconds` when set, else `latency_factor` times the estimated alone-time of the
    smallest contending tenant's work. With cost `fixed + per_token * n` and factor f, a tenant whose work
    is `n_min` tokens gets passes of `f * n_min + (f - 1) * fixed / per_token` tokens: on a GPU (fixed cost
    dominant) thousands of tokens, in practice all that is queued; on a CPU (per-token dominant) a few
    times `n_min`. Without a fit passes stay full, except that every `probe_every`-th contended pass starts
    a probe (passes of half the usual size until one has run), so that the model sees the sizes it needs.
    """

    def __init__(self, max_pass_seconds: float | None, latency_factor: float,
                 model: PassCostModel | None = None, probe_every: int = 8) -> None:
        self._max_pass_s = max_pass_seconds
        self._factor = latency_factor
        self.model = model or PassCostModel()
        self._probe_every = probe_every
        self._unfitted_budgets = 0
        self._probe: int | None = None
        """The token budget of a probe under way."""

    @property
    def enabled(self) -> bool:
        return self._max_pass_s is not None or self._factor > 0

    def observe(self, tokens: int, seconds: float) -> None:
        """A pass of `tokens` took `seconds` (from dispatch to completion)."""
        self.model.observe(tokens, seconds)
        if self._probe is not None and 0 < tokens <= self._probe:
            self._probe = None

    def target_s(self, smallest_work: int) -> float | None:
        """How long a pass should take beside a tenant whose queued work is `smallest_work` tokens."""
        if self._max_pass_s is not None:
            return self._max_pass_s
        alone_s = self.model.estimate(smallest_work)
        return None if alone_s is None or not self._factor > 0 else self._factor * alone_s

    def budget(self, hard_limit: int, smallest_work: int) -> int:
        """Tokens the next contended pass may hold (unpaced: the hard limit). A first request larger than
        the budget still runs, alone."""
        if not self.enabled:
            return hard_limit
        cost, target = self.model.cost(), self.target_s(min(smallest_work, hard_limit))
        if cost is None or target is None:
            return self._unfitted_budget(hard_limit)
        fixed, per_token = cost
        if per_token <= 0:
            return hard_limit if target >= fixed else 1
        # The epsilon keeps f = 1 from rounding n_min down to n_min - 1.
        return max(1, min(hard_limit, math.floor((target - fixed) / per_token + 1e-6)))

    def _unfitted_budget(self, hard_limit: int) -> int:
        """Full passes, and every so often a probe: half the usual size until a pass that small has run (a
        probe planned when only a big request is queued runs at full size, and would teach nothing), for at
        most `probe_every` passes (requests may all be too big to make one)."""
        self._unfitted_budgets += 1
        if not self._unfitted_budgets % self._probe_every:
            typical = self.model.typical_tokens()
            self._probe = None if self._probe is not None or typical is None else max(1, typical // 2)
        return hard_limit if self._probe is None else min(hard_limit, self._probe)
