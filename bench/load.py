"""Load and scale: N tenants train through the `tinker` SDK at once, for a bounded time, at several N.

Starts `carpool serve` (embedded, or `--mode cluster`) on the tiny random-weight dev model and, for each N
in `--tenants` (default 1, 8, 32, 128, 512), creates N tenants (keys written straight into the server's
database, the CLI would take seconds per tenant), gives each its own `ServiceClient` and LoRA model, and
runs them closed-loop for `--seconds`: forward_backward(1 x T tokens) → optim_step → next. The server's
resident adapter slots (`--resident`, default 16) are far below the larger N, so adapters spill and reload.

Per N: trained tokens/s, round-trip p50/p95 of forward_backward and optim_step, queue wait p95 (the
server's own `carpool_queue_wait_seconds` histogram when /metrics exports it, else "n/a"), errors, and the
server's RSS sampled every second (growth from the end of warm-up to the end of the run). The last line:

RESULT tokens_per_s_512_vs_8=X p95_wait_512_ms=X errors=N rss_growth_pct=X

(the largest N run stands in for 512 and the smallest N >= 8 for 8 when those are not in the list). The
figures mean little on a shared 2-core box; say so when quoting them (docs/reliability.md does).

    .venv/bin/python bench/load.py [--quick] [--tenants 1,8,32] [--seconds 20] [--mode embedded]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from tests.e2e.server import TINY_MODEL_NAME, Server, start_server  # noqa: E402

HP = types.AdamParams(learning_rate=1e-4)
SETUP_TIMEOUT_S = 600.0


@dataclass
class Run:
    tenants: int
    seconds: float = 0.0
    tokens: int = 0
    errors: int = 0
    rtt: dict[str, list[float]] = field(default_factory=lambda: {"fb": [], "optim": []})
    rss_mb: list[float] = field(default_factory=list)
    wait_p95_ms: float | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


def rss_mb(pid: int) -> float:
    """Resident memory of the server process and its children (MiB), from /proc."""
    total = 0
    for child in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{child}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return total / 1024


def _children(pid: int) -> list[int]:
    try:
        direct = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return [c for d in direct for c in (d, *_children(d))]


def make_keys(server: Server, count: int, offset: int) -> list[str]:
    """Tenants and keys written into the server's database directly (same code as `carpool tenants create`)."""
    from deploy.settings import ServiceSettings
    from services.auth.tenants import create_tenant_with_key
    from services.db import open_database

    url = server.env.get("CARPOOL_DATABASE_URL") or ServiceSettings(data_dir=server.data_dir).resolved_database_url()
    db = open_database(url)
    try:
        keys = []
        for i in range(count):
            with db.sessions.begin() as session:
                _, issued = create_tenant_with_key(session, f"load-{offset + i}")
            keys.append(issued.key)
        return keys
    finally:
        db.dispose()


def datum(i: int, tokens: int) -> types.Datum:
    seq = [(7 + 13 * (i + j)) % 500 + 1 for j in range(tokens + 1)]
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * tokens})


def tenant_loop(server: Server, key: str, index: int, run: Run, args: argparse.Namespace,
                start: threading.Barrier, deadline: list[float]) -> None:
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    try:
        training = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=args.rank).result(
            timeout=SETUP_TIMEOUT_S)
        data = [datum(index, args.tokens)]
        training.forward_backward(data, "cross_entropy").result(timeout=SETUP_TIMEOUT_S)  # warm
        training.optim_step(HP).result(timeout=SETUP_TIMEOUT_S)
        start.wait(timeout=SETUP_TIMEOUT_S)
        while time.monotonic() < deadline[0]:
            for kind, call in (("fb", lambda: training.forward_backward(data, "cross_entropy")),
                               ("optim", lambda: training.optim_step(HP))):
                began = time.monotonic()
                try:
                    call().result(timeout=SETUP_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - counted, the figure the run reports
                    with run.lock:
                        run.errors += 1
                    continue
                with run.lock:
                    run.rtt[kind].append(time.monotonic() - began)
                    if kind == "fb" and time.monotonic() <= deadline[0]:
                        run.tokens += args.tokens
    finally:
        service.holder.close()


def queue_wait_p95_ms(server: Server) -> float | None:
    """p95 of the server's queue-wait histogram, if /metrics exports one (bucket interpolation)."""
    try:
        text = httpx.get(f"{server.url}/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    buckets = []
    for line in text.splitlines():
        if line.startswith("carpool_queue_wait_seconds_bucket"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float("inf") if le == "+Inf" else float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    target = 0.95 * buckets[-1][1]
    return next(le * 1000 for le, count in buckets if count >= target)


def run_n(server: Server, n: int, offset: int, args: argparse.Namespace) -> Run:
    run = Run(n)
    keys = make_keys(server, n, offset)
    start = threading.Barrier(n + 1)
    deadline = [float("inf")]
    with ThreadPoolExecutor(max_workers=n) as pool:
        futures = [pool.submit(tenant_loop, server, key, i, run, args, start, deadline) for i, key in enumerate(keys)]
        start.wait(timeout=SETUP_TIMEOUT_S)
        began = time.monotonic()
        deadline[0] = began + args.seconds
        while time.monotonic() < deadline[0]:
            run.rss_mb.append(rss_mb(server.process.pid))
            time.sleep(1.0)
        run.seconds = time.monotonic() - began
        for future in futures:
            try:
                future.result(timeout=SETUP_TIMEOUT_S)
            except Exception:  # noqa: BLE001
                run.errors += 1
    run.wait_p95_ms = queue_wait_p95_ms(server)
    return run


def p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else values[0] * 1000


def report(runs: list[Run], rss_start: float, rss_end: float) -> None:
    print(f"{'N':>5} {'tok/s':>8} {'fb p50':>8} {'fb p95':>8} {'opt p50':>8} {'opt p95':>8} {'wait p95':>9} "
          f"{'errors':>6} {'rss MiB':>8}")
    for r in runs:
        wait = f"{r.wait_p95_ms:.0f}" if r.wait_p95_ms is not None else "n/a"
        print(f"{r.tenants:>5} {r.tokens_per_s:>8.1f} {p(r.rtt['fb'], 50):>8.0f} {p(r.rtt['fb'], 95):>8.0f} "
              f"{p(r.rtt['optim'], 50):>8.0f} {p(r.rtt['optim'], 95):>8.0f} {wait:>9} {r.errors:>6} "
              f"{max(r.rss_mb, default=0):>8.0f}")
    big = max(runs, key=lambda r: r.tenants)
    small = min((r for r in runs if r.tenants >= 8), key=lambda r: r.tenants, default=runs[0])
    ratio = big.tokens_per_s / small.tokens_per_s if small.tokens_per_s else float("nan")
    growth = 100 * (rss_end - rss_start) / rss_start if rss_start else float("nan")
    wait = f"{big.wait_p95_ms:.0f}" if big.wait_p95_ms is not None else "nan"
    print(f"(512 stands for N={big.tenants}, 8 for N={small.tenants})")
    print(f"RESULT tokens_per_s_512_vs_8={ratio:.2f} p95_wait_512_ms={wait} "
          f"errors={sum(r.errors for r in runs)} rss_growth_pct={growth:.1f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", default="1,8,32,128,512", help="comma-separated N values")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured time per N")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per forward_backward")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--resident", type=int, default=16, help="CARPOOL_MAX_RESIDENT_ADAPTERS of the server")
    parser.add_argument("--mode", default="embedded", choices=["embedded", "cluster"])
    parser.add_argument("--quick", action="store_true", help="N = 1, 8, 32 for 8 s each")
    args = parser.parse_args()
    if args.quick:
        args.tenants, args.seconds = "1,8,32", 8.0
    args.tenant_counts = [int(n) for n in args.tenants.split(",")]
    return args


def main() -> None:
    args = parse_args()
    from worker.models.devmodel import build_dev_model

    env = {"OMP_NUM_THREADS": "1", "CARPOOL_MAX_RESIDENT_ADAPTERS": str(args.resident)}
    with tempfile.TemporaryDirectory(prefix="carpool-bench-load-") as tmp:
        model_dir = build_dev_model(Path(tmp) / "model", layers=2, hidden=64, vocab=512, seed=0)
        server = start_server(Path(tmp) / "data", model_dir, extra_env=env, mode=args.mode)
        try:
            runs, offset = [], 0
            rss_start = rss_mb(server.process.pid)
            for n in args.tenant_counts:
                runs.append(run_n(server, n, offset, args))
                offset += n
                if len(runs) == 1:  # warm-up done: the first run loaded everything once
                    rss_start = runs[0].rss_mb[-1] if runs[0].rss_mb else rss_start
                print(f"N={n}: {runs[-1].tokens_per_s:.1f} tok/s, {runs[-1].errors} errors", flush=True)
            rss_end = rss_mb(server.process.pid)
        finally:
            server.stop()
    report(runs, rss_start, rss_end)


if __name__ == "__main__":
    main()
