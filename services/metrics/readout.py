"""Reading this process's own series back: histogram quantiles and means for the dashboard's overview.

The dashboard shows, per base model, the queue wait p50/p95 and adapters per pass that Prometheus would
compute; reading the registry directly keeps it useful where no Prometheus is deployed. Values are since
the process started (Prometheus, with `rate()`, shows recent windows instead).
"""

from __future__ import annotations

import math
from collections import defaultdict

from prometheus_client import CollectorRegistry


def _buckets(registry: CollectorRegistry, name: str, match: dict[str, str]) -> list[tuple[float, float]]:
    """(upper bound, cumulative count) of `name`'s buckets, summed over series whose labels include `match`."""
    totals: defaultdict[float, float] = defaultdict(float)
    for family in registry.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            if sample.name == f"{name}_bucket" and all(sample.labels.get(k) == v for k, v in match.items()):
                totals[float(sample.labels["le"])] += sample.value
    return sorted(totals.items())


def histogram_quantile(registry: CollectorRegistry, name: str, q: float, **match: str) -> float | None:
    """Prometheus' `histogram_quantile` over the cumulative buckets; None without observations."""
    buckets = _buckets(registry, name, match)
    if not buckets or buckets[-1][1] == 0:
        return None
    rank = q * buckets[-1][1]
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            share = (rank - lower_count) / (count - lower_count) if count > lower_count else 1.0
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, count
    return lower_bound


def histogram_mean(registry: CollectorRegistry, name: str, **match: str) -> float | None:
    total = count = 0.0
    for family in registry.collect():
        if family.name != name:
            continue
        for sample in family.samples:
            if all(sample.labels.get(k) == v for k, v in match.items()):
                if sample.name == f"{name}_sum":
                    total += sample.value
                elif sample.name == f"{name}_count":
                    count += sample.value
    return total / count if count else None
