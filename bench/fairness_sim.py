"""Fairness on a simulated engine: a light tenant's wait beside a heavy one, over engine shapes and client
turnarounds, without a server or wall-clock noise.

`bench/fairness.py` runs the real service core on this machine's CPU, where the engine's shape (how much of a
pass is fixed cost) and the clients' turnaround move with the machine's load from run to run. This script
drives the real `Scheduler` through `ClosedLoopSim` (`services/scheduler/simulation.py`) with stated shapes
instead, the same workload as `bench/fairness.py`: tenant B one model, 64 tokens a step; tenant A ten
models of 64 tokens back to back (1 ms turnaround). For each shape (pass = fixed + per-token cost, barrier
1 ms), B's turnaround (3 ms: an in-process client; 15 ms: an SDK client over HTTP) and client kind
(pipelined: optim_step submitted with its forward_backward, as the SDK's futures allow; sequential: after its
result), it prints B's median wait beside A over its median wait alone, and both tenants' tokens/s.

    .venv/bin/python bench/fairness_sim.py [--seconds 30] [--seed 0]

The last line: RESULT worst_ratio=X median_ratio=X (over every row, the service's default scheduler).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.scheduler import SchedulerLimits  # noqa: E402
from services.scheduler.simulation import Client, EngineCost, wait_ratio_beside  # noqa: E402

SHAPES = {
    "cpu 12 ms + 0.30 ms/tok": (0.012, 0.0003),
    "cpu 25 ms + 0.50 ms/tok": (0.025, 0.0005),
    "cpu 16.6 ms + 0.185 ms/tok": (0.0166, 0.000185),
    "cpu 41 ms + 0.26 ms/tok": (0.041, 0.00026),
    "gpu 30 ms + 0.02 ms/tok": (0.030, 0.00002),
}
"""Fits the pacer made in bench/fairness.py runs on this 2-core machine (2026-12-05), the CPU shape of the
unit tests, and a GPU-like shape (fixed cost dominant)."""


def light_ratio(cost: EngineCost, turnaround_s: float, pipelined: bool, args: argparse.Namespace,
                limits: SchedulerLimits) -> tuple[float, float, float]:
    """(B's median wait beside A / alone, A's tokens/s, B's tokens/s beside A)."""
    light = Client("light", 64, turnaround_s, pipelined=pipelined)
    heavy = Client("heavy", 64, 0.001, models=10, pipelined=pipelined)
    ratio, shared = wait_ratio_beside(limits, cost, light, [heavy], seconds=args.seconds,
                                      alone_seconds=args.seconds / 3, seed=args.seed)
    return ratio, shared.tokens["heavy"] / shared.seconds, shared.tokens["light"] / shared.seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="simulated seconds beside A")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    variants = {"default": SchedulerLimits(), "pacing off": SchedulerLimits(pass_latency_factor=0, hold_factor=0)}
    print(f"{'shape':<28} {'B turn':>6} {'client':<10} " + " ".join(f"{name + ' B ratio/A tok/s/B tok/s':>36}"
                                                               for name in variants))
    ratios: list[float] = []
    for shape, (fixed_s, per_token_s) in SHAPES.items():
        cost = EngineCost(fixed_s, per_token_s, barrier_s=0.001)
        for turnaround_s in (0.003, 0.015):
            for pipelined in (True, False):
                cells = []
                for name, limits in variants.items():
                    ratio, heavy, light = light_ratio(cost, turnaround_s, pipelined, args, limits)
                    if name == "default":
                        ratios.append(ratio)
                    cells.append(f"{ratio:>14.2f} {heavy:>10.0f} {light:>10.0f}")
                print(f"{shape:<28} {turnaround_s * 1000:>4.0f}ms {'pipelined' if pipelined else 'sequential':<10} "
                      + " ".join(f"{c:>36}" for c in cells))
    print(f"RESULT worst_ratio={max(ratios):.2f} median_ratio={statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
