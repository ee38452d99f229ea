"""Cluster benchmark: what the production data plane costs next to the embedded server, on one box.

Starts both deployments as the e2e suites do (`tests/e2e/server.py`): `carpool serve` (embedded: gateway,
scheduler and engine in one process, SQLite) and `carpool cluster up` (gateway → Redis → scheduler service →
Ray Serve worker replica, PostgreSQL) on the same random-weight dev Qwen3 (hidden 256 × 4 layers, vocab 2048),
and measures through the unmodified `tinker` SDK:

  (a) aggregate training throughput: `--tenants` tenants at once, each looping forward_backward (2 × 64
      tokens) + optim_step and waiting for both, like an SFT loop. tokens/s = all tenants' tokens ÷ wall
      time, after one warm-up step each. The two deployments alternate in `--rounds` rounds.
  (b) per-request latency: one tenant's forward_backward round trips (16 tokens, `.result()` each),
      alternating blocks between the deployments. The cluster path's overhead quantile q is
      quantile_q(cluster round trip) − median(embedded round trip): what Redis, the scheduler service and
      the replica hop add per request on top of what the embedded server already costs.

Both servers run torch single-threaded (OMP_NUM_THREADS=1, and one replica with num_cpus 0.5), so the two
cores are shared alike. Prints a table; the last line is machine-readable:
RESULT embedded_tokens_per_s=X cluster_tokens_per_s=X cluster_ratio=X overhead_p50_ms=X overhead_p95_ms=X

    .venv/bin/python bench/cluster.py [--tenants 8] [--steps 6] [--rounds 2] [--iterations 60]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from tests.e2e.server import TINY_MODEL_NAME, Server, start_server  # noqa: E402
from worker.models.devmodel import build_dev_model  # noqa: E402

RANK = 8
TOKENS_PER_SEQUENCE = 64
SEQUENCES_PER_STEP = 2
SERVER_ENV = {"OMP_NUM_THREADS": "1", "CARPOOL_BATCH_WINDOW_MS": "5"}


def quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q))


def datums(rng: np.random.Generator, count: int, length: int) -> list[types.Datum]:
    out = []
    for _ in range(count):
        tokens = rng.integers(1, 2048, length + 1).tolist()
        out.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                               loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length}))
    return out


class Tenant:
    """One SDK client with one LoRA model on a server."""

    def __init__(self, server: Server, name: str, seed: int) -> None:
        self.client = tinker.ServiceClient(base_url=server.url, api_key=server.create_tenant(name))
        self.training = self.client.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=RANK,
                                                                seed=seed).result()
        self.rng = np.random.default_rng(seed)

    def step(self) -> int:
        batch = datums(self.rng, SEQUENCES_PER_STEP, TOKENS_PER_SEQUENCE)
        fb = self.training.forward_backward(batch, "cross_entropy")
        optim = self.training.optim_step(types.AdamParams(learning_rate=1e-3))
        fb.result()
        optim.result()
        return SEQUENCES_PER_STEP * TOKENS_PER_SEQUENCE

    def round_trip_ms(self) -> float:
        batch = datums(self.rng, 1, 16)
        started = time.perf_counter()
        self.training.forward_backward(batch, "cross_entropy").result()
        return (time.perf_counter() - started) * 1000


def throughput(tenants: list[Tenant], steps: int) -> float:
    """tokens/s of every tenant stepping at once."""
    with ThreadPoolExecutor(max_workers=len(tenants)) as pool:
        list(pool.map(lambda t: t.step(), tenants))  # warm-up: first passes, allocations
        started = time.perf_counter()
        tokens = sum(pool.map(lambda t: sum(t.step() for _ in range(steps)), tenants))
        return tokens / (time.perf_counter() - started)


def latencies(probes: dict[str, Tenant], iterations: int, blocks: int = 4) -> dict[str, list[float]]:
    """Round trips per deployment, alternating blocks so drift hits both alike."""
    out: dict[str, list[float]] = {name: [] for name in probes}
    for probe in probes.values():
        probe.round_trip_ms()  # warm-up
    for _ in range(blocks):
        for name, probe in probes.items():
            time.sleep(0.5)
            out[name] += [probe.round_trip_ms() for _ in range(iterations // blocks)]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--steps", type=int, default=6, help="Measured steps per tenant per round.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--iterations", type=int, default=60, help="Round trips per deployment for (b).")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="carpool-bench-cluster-"))
    model_dir = build_dev_model(work / "model", layers=4, hidden=256, vocab=2048, seed=0)
    servers = {mode: start_server(work / mode, model_dir, mode=mode, extra_env=SERVER_ENV, timeout_s=300)
               for mode in ("embedded", "cluster")}
    try:
        tenants = {mode: [Tenant(srv, f"bench-{i}", seed=i) for i in range(args.tenants)]
                   for mode, srv in servers.items()}
        rates: dict[str, list[float]] = {mode: [] for mode in servers}
        for _ in range(args.rounds):
            for mode in servers:
                rates[mode].append(throughput(tenants[mode], args.steps))
        probes = {mode: Tenant(srv, "probe", seed=99) for mode, srv in servers.items()}
        trips = latencies(probes, args.iterations)
    finally:
        for srv in servers.values():
            srv.stop()
    report(args, rates, trips)


def report(args: argparse.Namespace, rates: dict[str, list[float]], trips: dict[str, list[float]]) -> None:
    embedded, cluster = statistics.median(rates["embedded"]), statistics.median(rates["cluster"])
    base = statistics.median(trips["embedded"])
    overhead = [t - base for t in trips["cluster"]]
    print(f"{args.tenants} tenants × {args.steps} steps × {SEQUENCES_PER_STEP}×{TOKENS_PER_SEQUENCE} tokens, "
          f"{args.rounds} rounds (median of rounds)")
    print(f"{'deployment':<12} {'tokens/s':>10} {'rounds':>24} {'fb p50 ms':>10} {'fb p95 ms':>10}")
    for mode, rate in (("embedded", embedded), ("cluster", cluster)):
        shown = ", ".join(f"{r:.0f}" for r in rates[mode])
        print(f"{mode:<12} {rate:>10.0f} {shown:>24} {quantile(trips[mode], 0.5):>10.1f} "
              f"{quantile(trips[mode], 0.95):>10.1f}")
    print(f"cluster/embedded throughput: {cluster / embedded:.2f}; cluster overhead per request: "
          f"p50 {quantile(overhead, 0.5):.1f} ms, p95 {quantile(overhead, 0.95):.1f} ms")
    print(f"RESULT embedded_tokens_per_s={embedded:.0f} cluster_tokens_per_s={cluster:.0f} "
          f"cluster_ratio={cluster / embedded:.2f} overhead_p50_ms={quantile(overhead, 0.5):.1f} "
          f"overhead_p95_ms={quantile(overhead, 0.95):.1f}")


if __name__ == "__main__":
    main()
