"""Load and scale: N tenants train through the `tinker` SDK at once, for a bounded time, at several N.

Starts `carpool cluster up` (the default `--mode cluster`) with the scheduler in a process of its own as
production runs it (`CARPOOL_SCHEDULER_PROCESSES`; `--scheduler-thread` keeps it in the gateway's process),
or `carpool serve` (`--mode embedded`), on the tiny random-weight dev model and, for each N
in `--tenants` (default 1, 8, 32, 128, 512), creates N tenants (keys written straight into the server's
database, the CLI would take seconds per tenant), gives each its own `ServiceClient` and LoRA model, and
runs them closed-loop for `--seconds`: forward_backward(1 x T tokens) → optim_step → next. The server's
resident adapter slots (`--resident`, default 16) are far below the larger N, so adapters spill and reload.

What it compares: every tenant at every N sends the same work (one T-token datum per forward_backward,
then an optim_step, waiting for each result), so tokens/s at 512 vs 8 is the total trained throughput of
512 small tenants against 8 of the same — how much per-tenant overhead (spills, bookkeeping, per-client
traffic such as heartbeats and auth) costs, not a change in work per pass.

The clients run in `ceil(N / --tenants-per-proc)` processes (`--client-procs` to force), each a thread
and `ServiceClient` per tenant on that process's one SDK event loop: 512 clients in one process measured
the client's own event loop. Each process sets all its tenants up (model created, one warm step) before
the driver starts the clock for everyone. The client processes share the box with the server: their CPU
use is reported beside the server's so a client-bound run shows as one.

Per N: trained tokens/s, round-trip p50/p95 of forward_backward and optim_step, queue wait p95 (the
server's `carpool_queue_wait_seconds` histogram, the bucket holding the p95 of this N's requests only),
errors, the server's RSS sampled every second (max, and growth over this N's measured time), and the cores
the server and the clients used (the server's also per process of its tree). The last line:

RESULT tokens_per_s_512_vs_8=X p95_wait_512_ms=X errors=N rss_growth_pct=X

(rss_growth_pct: from the end of the first N, the warm-up, to the end of the run, so it includes every
later N's new tenants; the largest N run stands in for 512 and the smallest N >= 8 for 8 when those are not
in the list). The figures mean little on a shared 2-core box; say so when quoting them (docs/reliability.md
does).

    .venv/bin/python bench/load.py [--quick] [--tenants 1,8,32] [--seconds 20] [--mode embedded|cluster]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from tests.e2e.server import TINY_MODEL_NAME, Server, free_port, start_server  # noqa: E402

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
    server_cpu: float = 0.0
    """Cores the server used over the measured time (CPU seconds / seconds; 2.0 is this whole box)."""
    client_cpu: float = 0.0
    """Cores the client processes used over the measured time."""
    client_procs: int = 1
    reloads: float | None = None
    """Spilled adapters brought back (`carpool_adapter_reloads_total`) during the measured time."""
    steps: int = 0
    """forward_backward calls completed in the measured time."""
    connections: int = 0
    """The server's open sockets at the end of the measured time (the SDK keeps ~3 per client)."""
    process_cpu: dict[str, float] = field(default_factory=dict)
    """Cores used over the measured time per process label of the server's tree (`process_label`)."""

    @property
    def reloads_per_step(self) -> float:
        """Adapter reloads per tenant step (fb + optim_step): 0 while every adapter stays resident; 1 is the
        least when adapters outnumber the slots (each step brings its adapter back once)."""
        return self.reloads / self.steps if self.reloads is not None and self.steps else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0

    @property
    def rss_window_growth_pct(self) -> float:
        """RSS growth over this N's measured time (its tenants all set up: memory over time, not per tenant)."""
        if len(self.rss_mb) < 2 or not self.rss_mb[0]:
            return float("nan")
        return 100 * (self.rss_mb[-1] - self.rss_mb[0]) / self.rss_mb[0]


@dataclass
class ClientTotals:
    """What one client process measured; sent back to the driver."""

    tokens: int = 0
    errors: int = 0
    rtt: dict[str, list[float]] = field(default_factory=lambda: {"fb": [], "optim": []})
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def __getstate__(self) -> dict[str, object]:
        return {k: v for k, v in self.__dict__.items() if k != "lock"}

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state, lock=threading.Lock())


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


def open_sockets(pid: int) -> int:
    """Sockets the server process and its children hold open (client connections, database, Redis), from /proc."""
    total = 0
    for child in [pid, *_children(pid)]:
        try:
            fds = list(Path(f"/proc/{child}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                total += os.readlink(fd).startswith("socket:")
            except OSError:
                continue  # closed meanwhile
    return total


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of a process and its children so far, from /proc."""
    return sum(cpu_by_process(pid).values())


def cpu_by_process(pid: int) -> dict[str, float]:
    """CPU seconds so far of a process and its children, summed per process label (`process_label`): in
    cluster mode the tree is the gateway, scheduler, Ray's daemons and the replica."""
    totals: dict[str, float] = {}
    for child in [pid, *_children(pid)]:
        try:
            fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
            label = process_label(child)
        except OSError:
            continue
        seconds = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime
        totals[label] = totals.get(label, 0.0) + seconds
    return totals


def process_label(pid: int) -> str:
    """A short name for a process: Ray workers' titles (`ray::ReplicaHost...`), else the program and its
    first word of arguments that is not an option (`carpool scheduler`, `raylet`, `postgres`)."""
    argv = [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if a]
    if not argv:
        return "?"
    if argv[0].startswith("ray::"):
        return argv[0].split()[0][:40]
    words = [Path(a).name for a in argv[:4] if not a.startswith("-")]
    if words and words[0].startswith("python"):
        words = words[1:]
    return " ".join(words[:2])[:40] or Path(argv[0]).name


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


@dataclass(frozen=True)
class Phase:
    """How one client process's tenants start together: set up, report ready, wait for go, run to the
    deadline the driver wrote (time.monotonic is the same clock in every process of the box)."""

    ready: threading.Barrier
    go: Any
    deadline: Any


def tenant_loop(url: str, key: str, index: int, totals: ClientTotals, args: argparse.Namespace,
                phase: Phase) -> None:
    service = tinker.ServiceClient(base_url=url, api_key=key)
    try:
        training = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=args.rank).result(
            timeout=SETUP_TIMEOUT_S)
        data = [datum(index, args.tokens)]
        training.forward_backward(data, "cross_entropy").result(timeout=SETUP_TIMEOUT_S)  # warm
        training.optim_step(HP).result(timeout=SETUP_TIMEOUT_S)
        phase.ready.wait(timeout=SETUP_TIMEOUT_S)
        phase.go.wait(SETUP_TIMEOUT_S)
        deadline = phase.deadline.value
        while time.monotonic() < deadline:
            for kind, call in (("fb", lambda: training.forward_backward(data, "cross_entropy")),
                               ("optim", lambda: training.optim_step(HP))):
                began = time.monotonic()
                try:
                    call().result(timeout=SETUP_TIMEOUT_S)
                except Exception:  # noqa: BLE001 - counted, the figure the run reports
                    with totals.lock:
                        totals.errors += 1
                    continue
                with totals.lock:
                    totals.rtt[kind].append(time.monotonic() - began)
                    if kind == "fb" and time.monotonic() <= deadline:
                        totals.tokens += args.tokens
    finally:
        service.holder.close()


def client_process(url: str, keys: list[str], indices: list[int], args: argparse.Namespace, ready: Any,
                   go: Any, deadline: Any, out: Any) -> None:
    """One client process: a thread (and `ServiceClient`) per tenant, all on this process's one SDK event
    loop; reports ready once every tenant is set up, and its totals after the deadline."""
    totals = ClientTotals()
    phase = Phase(threading.Barrier(len(keys) + 1), go, deadline)
    with ThreadPoolExecutor(max_workers=len(keys)) as pool:
        futures = [pool.submit(tenant_loop, url, key, i, totals, args, phase)
                   for key, i in zip(keys, indices, strict=True)]
        phase.ready.wait(timeout=SETUP_TIMEOUT_S)
        ready.put(os.getpid())
        for future in futures:
            try:
                future.result(timeout=SETUP_TIMEOUT_S)
            except Exception:  # noqa: BLE001
                totals.errors += 1
    out.put(totals)


def run_n(server: Server, n: int, offset: int, args: argparse.Namespace) -> Run:
    run = Run(n)
    keys = make_keys(server, n, offset)
    scheduler_metrics = metrics_url(server, args)
    waits_before = queue_wait_buckets(scheduler_metrics)
    procs = run.client_procs = max(1, min(n, args.client_procs or -(-n // args.tenants_per_proc)))
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no SDK threads forked half-way
    ready, out, go, deadline = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("d", float("inf"))
    workers = [ctx.Process(target=client_process, daemon=True,
                           args=(server.url, keys[k::procs], list(range(n))[k::procs], args, ready, go, deadline,
                                 out)) for k in range(procs)]
    for worker in workers:
        worker.start()
    pids = [ready.get(timeout=SETUP_TIMEOUT_S) for _ in workers]
    print(f"N={n}: set up in {procs} client processes, measuring for {args.seconds:.0f} s "
          f"(server pid {server.process.pid}, client pids {' '.join(map(str, pids))})", flush=True)
    by_process, client_cpu = cpu_by_process(server.process.pid), sum(cpu_s(pid) for pid in pids)
    server_cpu = sum(by_process.values())
    reloads_before = metric_total(scheduler_metrics, "carpool_adapter_reloads_total")
    began = time.monotonic()
    deadline.value = began + args.seconds
    go.set()
    while time.monotonic() < deadline.value:
        run.rss_mb.append(rss_mb(server.process.pid))
        time.sleep(1.0)
    run.seconds = time.monotonic() - began
    run.connections = open_sockets(server.process.pid)
    after = cpu_by_process(server.process.pid)
    run.server_cpu = (sum(after.values()) - server_cpu) / run.seconds
    run.process_cpu = {label: (seconds - by_process.get(label, 0.0)) / run.seconds
                       for label, seconds in after.items()}
    run.client_cpu = (sum(cpu_s(pid) for pid in pids) - client_cpu) / run.seconds
    for _ in workers:
        totals: ClientTotals = out.get(timeout=SETUP_TIMEOUT_S)
        run.tokens += totals.tokens
        run.errors += totals.errors
        for kind, values in totals.rtt.items():
            run.rtt[kind].extend(values)
    for worker in workers:
        worker.join(timeout=60)
    run.wait_p95_ms = wait_p95_ms(waits_before, queue_wait_buckets(scheduler_metrics))
    reloads_after = metric_total(scheduler_metrics, "carpool_adapter_reloads_total")
    if reloads_before is not None and reloads_after is not None:
        run.reloads = reloads_after - reloads_before
    run.steps = len(run.rtt["fb"])
    return run


def metrics_url(server: Server, args: argparse.Namespace) -> str:
    """Where the scheduler's series are: the scheduler child's own port in cluster mode (unless
    `--scheduler-thread`), else the gateway's /metrics."""
    if args.scheduler_metrics_port is not None:
        return f"http://127.0.0.1:{args.scheduler_metrics_port}/metrics"
    return f"{server.url}/metrics"


def metric_lines(url: str, prefix: str) -> list[str]:
    """The /metrics sample lines at `url` starting with `prefix`; [] if it cannot be read."""
    try:
        text = httpx.get(url, timeout=10).text
    except httpx.HTTPError:
        return []
    return [line for line in text.splitlines() if line.startswith(prefix)]


def metric_total(url: str, name: str) -> float | None:
    """The sum of a counter over its label sets on the server's /metrics; None if it exports none."""
    values = [float(line.rsplit(" ", 1)[1]) for line in metric_lines(url, name)]
    return sum(values) if values else None


def queue_wait_buckets(url: str) -> list[tuple[float, float]]:
    """(le, cumulative count) of the server's queue-wait histogram, summed over its label sets; [] if /metrics
    exports none."""
    counts: dict[float, float] = {}
    for line in metric_lines(url, "carpool_queue_wait_seconds_bucket"):
        le = line.split('le="', 1)[1].split('"', 1)[0]
        bound = float("inf") if le == "+Inf" else float(le)
        counts[bound] = counts.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return sorted(counts.items())


def wait_p95_ms(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float | None:
    """p95 queue wait of the requests counted between two reads of the histogram (the bucket it falls in:
    the histogram is cumulative over the server's life, so earlier N's waits are subtracted)."""
    earlier = dict(before)
    delta = [(le, count - earlier.get(le, 0.0)) for le, count in after]
    if not delta or delta[-1][1] <= 0:
        return None
    target = 0.95 * delta[-1][1]
    return next(le * 1000 for le, count in delta if count >= target)


def p(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    return statistics.quantiles(values, n=100)[int(q) - 1] * 1000 if len(values) > 1 else values[0] * 1000


def report(runs: list[Run], rss_start: float, rss_end: float, tokens: int) -> None:
    print(f"{'N':>5} {'tok/s':>8} {'fb p50':>8} {'fb p95':>8} {'opt p50':>8} {'opt p95':>8} {'wait p95':>9} "
          f"{'errors':>6} {'rss MiB':>8} {'rss Δ%':>6} {'srv cpu':>7} {'cli cpu':>7} {'procs':>5} {'reloads/step':>12} "
          f"{'sockets':>7}")
    for r in runs:
        wait = f"{r.wait_p95_ms:.0f}" if r.wait_p95_ms is not None else "n/a"
        print(f"{r.tenants:>5} {r.tokens_per_s:>8.1f} {p(r.rtt['fb'], 50):>8.0f} {p(r.rtt['fb'], 95):>8.0f} "
              f"{p(r.rtt['optim'], 50):>8.0f} {p(r.rtt['optim'], 95):>8.0f} {wait:>9} {r.errors:>6} "
              f"{max(r.rss_mb, default=0):>8.0f} {r.rss_window_growth_pct:>6.1f} {r.server_cpu:>7.2f} "
              f"{r.client_cpu:>7.2f} {r.client_procs:>5} {r.reloads_per_step:>12.2f} {r.connections:>7}")
    for r in runs:
        busiest = sorted(r.process_cpu.items(), key=lambda item: -item[1])[:6]
        print(f"N={r.tenants} server cores by process: " + ", ".join(f"{k} {v:.2f}" for k, v in busiest))
    big = max(runs, key=lambda r: r.tenants)
    small = min((r for r in runs if r.tenants >= 8), key=lambda r: r.tenants, default=runs[0])
    ratio = big.tokens_per_s / small.tokens_per_s if small.tokens_per_s else float("nan")
    growth = 100 * (rss_end - rss_start) / rss_start if rss_start else float("nan")
    wait = f"{big.wait_p95_ms:.0f}" if big.wait_p95_ms is not None else "nan"
    print(f"(512 stands for N={big.tenants}, 8 for N={small.tenants}; every tenant sends the same 1 x "
          f"{tokens}-token forward_backward + optim_step in a closed loop, so the ratio compares total "
          f"trained tokens/s of many small tenants with few; rss growth: from the end of the first N to the end, "
          f"so it includes every later N's new tenants; rss Δ%: over one N's measured time; cpu: cores used, of "
          f"{os.cpu_count()})")
    if big.connections > small.connections and big.rss_mb and small.rss_mb:
        per_socket = (big.rss_mb[-1] - small.rss_mb[-1]) * 1024 / (big.connections - small.connections)
        print(f"rss added per added open socket, N={small.tenants} to N={big.tenants}: {per_socket:.0f} KiB")
    print(f"RESULT tokens_per_s_512_vs_8={ratio:.2f} p95_wait_512_ms={wait} "
          f"errors={sum(r.errors for r in runs)} rss_growth_pct={growth:.1f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", default="1,8,32,128,512", help="comma-separated N values")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured time per N")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per forward_backward")
    parser.add_argument("--rank", type=int, default=4)
    parser.add_argument("--resident", type=int, default=16, help="CARPOOL_MAX_RESIDENT_ADAPTERS of the server")
    parser.add_argument("--mode", default="cluster", choices=["embedded", "cluster"],
                        help="cluster (default: the deployment for many tenants, as issue 13 asks) or embedded")
    parser.add_argument("--scheduler-thread", action="store_true",
                        help="cluster mode: keep the scheduler in the gateway's process (`cluster up`'s default) "
                             "instead of its own process, as production runs it")
    parser.add_argument("--quick", action="store_true", help="N = 1, 8, 32 for 8 s each")
    parser.add_argument("--client-procs", type=int, default=0,
                        help="client processes per N (0: one per --tenants-per-proc tenants)")
    parser.add_argument("--tenants-per-proc", type=int, default=64,
                        help="tenants per client process when --client-procs is 0")
    args = parser.parse_args()
    if args.quick:
        args.tenants, args.seconds = "1,8,32", 8.0
    args.tenant_counts = [int(n) for n in args.tenants.split(",")]
    return args


def main() -> None:
    args = parse_args()
    from worker.models.devmodel import build_dev_model

    env = {"OMP_NUM_THREADS": "1", "CARPOOL_MAX_RESIDENT_ADAPTERS": str(args.resident)}
    args.scheduler_metrics_port = None
    if args.mode == "cluster" and not args.scheduler_thread:
        args.scheduler_metrics_port = free_port()
        env |= {"CARPOOL_SCHEDULER_PROCESSES": "true",
                "CARPOOL_SCHEDULER_METRICS_PORT": str(args.scheduler_metrics_port)}
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
    report(runs, rss_start, rss_end, args.tokens)


if __name__ == "__main__":
    main()
