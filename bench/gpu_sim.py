"""Scheduler simulation for a GPU: the real `Scheduler` driven by a simulated engine and 64 closed-loop tenants.

No GPU, no server, no wall clock: `services/scheduler/simulation.py` runs the scheduler on a simulated
clock, the way `services/runtime/loop.py` does (step, run the items one after another, complete them, wait
out holds until the next arrival). Every tenant is an SDK training loop: forward_backward of `--tokens`
tokens -> result -> optim_step -> result -> think -> next; its next request reaches the scheduler a
turnaround after its result (long-poll wake-up, HTTP, SDK; seeded jitter ±`--jitter`), plus think time
(exponentially distributed per tenant around `--think-ms`, the data preparation or rollouts a client does).

Engine constants (stated, not measured here): a packed pass costs `--fixed-ms` + `--per-token-ms` per token,
by default 8 ms + 0.02 ms/token, about an 8B model's LoRA forward+backward on one H100-class GPU at ~40 %
MFU (4 * 8e9 FLOPs per token / 0.4 / 990e12 FLOP/s = 0.08 ms per token for a full 8B; 0.02 ms is a 2B-class
model or several GPUs; try `--per-token-ms 0.08`); an optim_step barrier 0.5 ms (deferred AdamW steps
apply in the next pass).

Reports, per scheduler configuration (hold on, the default; hold off, the behaviour before issue 10):
tenants per pass, tokens per pass, throughput, fb latency p50/p95, and each against the ideal: packing as
the mean over passes of its tenants over the tenants active at its dispatch (not thinking; 1 = every
active tenant in every pass), throughput as the lesser of full passes back to back and the clients' own
pace. Last line (one line):
RESULT gpu_sim_tenants_per_pass=X gpu_sim_packing_vs_ideal=X gpu_sim_throughput_vs_ideal=X
       gpu_sim_hold_off_packing_vs_ideal=X

    .venv/bin/python bench/gpu_sim.py [--tenants 64] [--tokens 512] [--seconds 60]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.scheduler import SchedulerLimits  # noqa: E402
from services.scheduler.simulation import Client, ClosedLoopSim, EngineCost, SimReport  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per forward_backward of each tenant")
    parser.add_argument("--fixed-ms", type=float, default=8.0)
    parser.add_argument("--per-token-ms", type=float, default=0.02)
    parser.add_argument("--barrier-ms", type=float, default=0.5)
    parser.add_argument("--turnaround-ms", type=float, default=10.0)
    parser.add_argument("--think-ms", type=float, default=50.0, help="mean client think time before each step")
    parser.add_argument("--jitter", type=float, default=0.3)
    parser.add_argument("--max-tokens-per-pass", type=int, default=32768)
    parser.add_argument("--seconds", type=float, default=60.0, help="simulated seconds (after 10 s warm-up)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--hold-factor", type=float, default=SchedulerLimits.hold_factor)
    parser.add_argument("--max-hold-ms", type=float, default=SchedulerLimits.max_hold_seconds * 1000)
    return parser.parse_args()


def clients(args: argparse.Namespace) -> list[Client]:
    rng = random.Random(args.seed)
    return [Client(f"t{i}", args.tokens, args.turnaround_ms / 1000,
                   think_s=rng.expovariate(1000 / args.think_ms) if args.think_ms > 0 else 0.0,
                   start_s=rng.uniform(0, 0.5)) for i in range(args.tenants)]


def simulate(args: argparse.Namespace, limits: SchedulerLimits) -> SimReport:
    cost = EngineCost(args.fixed_ms / 1000, args.per_token_ms / 1000, barrier_s=args.barrier_ms / 1000)
    sim = ClosedLoopSim(limits, cost, clients(args), jitter=args.jitter, seed=args.seed)
    sim.run(10.0)  # warm-up: forecasts learn the turnarounds, pacing fits the pass cost
    sim.report = SimReport()
    return sim.run(args.seconds)


def ideal(args: argparse.Namespace) -> tuple[float, float]:
    """(tenants per pass, tokens/s) of the ideal: every tenant in every pass (as many as the token budget
    holds), and throughput the lesser of the engine running such passes back to back and the clients' own
    pace (each tenant's cycle with no queueing: its pass alone, its barrier, two turnarounds, think time)."""
    per_pass = min(args.tenants, max(1, args.max_tokens_per_pass // args.tokens))
    engine = per_pass * args.tokens / ((args.fixed_ms + args.per_token_ms * per_pass * args.tokens) / 1000)
    alone_ms = args.fixed_ms + args.per_token_ms * args.tokens + args.barrier_ms + 2 * args.turnaround_ms
    clients_bound = sum(args.tokens / ((alone_ms + c.think_s * 1000) / 1000) for c in clients(args))
    return float(per_pass), min(engine, clients_bound)


def row(name: str, report: SimReport, ideal_tenants: float, ideal_tok_s: float) -> str:
    latencies = sorted(x for v in report.latencies.values() for x in v)
    p50 = statistics.median(latencies) * 1000 if latencies else float("nan")
    p95 = latencies[int(0.95 * len(latencies))] * 1000 if latencies else float("nan")
    tokens = statistics.mean(report.pass_tokens) if report.pass_tokens else 0.0
    return (f"{name:<12} {report.mean_tenants_per_pass:>8.2f} {tokens:>9.0f} {report.tokens_per_s:>10.0f} "
            f"{report.packing_vs_active:>9.2f} {report.tokens_per_s / ideal_tok_s:>9.2f} "
            f"{p50:>8.1f} {p95:>8.1f} {len(report.pass_tokens):>7}")


def main() -> None:
    args = parse_args()
    held = simulate(args, SchedulerLimits(max_tokens_per_pass=args.max_tokens_per_pass, hold_factor=args.hold_factor,
                                          max_hold_seconds=args.max_hold_ms / 1000))
    unheld = simulate(args, SchedulerLimits(max_tokens_per_pass=args.max_tokens_per_pass, hold_factor=0))
    ideal_tenants, ideal_tok_s = ideal(args)
    print(f"{args.tenants} tenants x {args.tokens} tokens, pass {args.fixed_ms} ms + {args.per_token_ms} ms/token, "
          f"turnaround {args.turnaround_ms} ms, think ~{args.think_ms} ms, {args.seconds:.0f} simulated s")
    print(f"ideal: every active (not thinking) tenant in every pass (at most {ideal_tenants:.0f}), "
          f"{ideal_tok_s:.0f} tokens/s")
    print(f"{'scheduler':<12} {'ten/pass':>8} {'tok/pass':>9} {'tok/s':>10} {'pack/ide':>9} {'thr/ide':>9} "
          f"{'fb p50ms':>8} {'fb p95ms':>8} {'passes':>7}")
    print(row("hold (new)", held, ideal_tenants, ideal_tok_s))
    print(row("no hold", unheld, ideal_tenants, ideal_tok_s))
    print(f"RESULT gpu_sim_tenants_per_pass={held.mean_tenants_per_pass:.2f} "
          f"gpu_sim_packing_vs_ideal={held.packing_vs_active:.3f} "
          f"gpu_sim_throughput_vs_ideal={held.tokens_per_s / ideal_tok_s:.3f} "
          f"gpu_sim_hold_off_packing_vs_ideal={unheld.packing_vs_active:.3f}")


if __name__ == "__main__":
    main()
