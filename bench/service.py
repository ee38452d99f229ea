"""Service benchmark: do independent SDK clients share passes through the real service path?

Starts `carpool serve` (embedded, or `--mode cluster`) as a subprocess on a tiny random-weight Qwen3
(hidden 256, 4 layers, vocab 4096) and drives it with the unmodified `tinker` SDK, every tenant its own API
key (created with the real CLI), each in its own thread, closed loop:

    train   each of N tenants: forward_backward(1 x T tokens) -> result -> optim_step -> result -> next;
            against ONE tenant sending the same tokens per step (N x T) the same way
    sample  each of N tenants: sample(num_samples=S, max_tokens=T) from its own adapter -> result -> next;
            against ONE tenant asking N x S samples per call
    alone   one tenant, forward_backward(1 x T) -> optim_step, nobody else: its round trips

Per phase: tokens/s (trained tokens, or generated tokens), **server CPU-seconds per token** (utime+stime of
the server's process tree from /proc, the robust measure on a shared machine: clients compete with the server
for the cores, so wall-clock ratios understate it), tenants and tokens per pass and requests per sample batch
(from the server's pass log lines, `services/runtime/dispatch.py`), and round-trip p50/p95 per request kind.
The server runs torch with `--torch-threads` intra-op threads (default 1, as `bench/gateway.py`: on two shared
cores OpenMP threads spin-waiting between passes would be billed as CPU and bury the service's share).
With `--threads`, the server's CPU per client call by thread, and the scheduler loop thread's split by part
(its backend calls against the bookkeeping and planning around them: `carpool_scheduler_loop_cpu_seconds_total`
from the server's /metrics, embedded mode).

The last line is machine-readable (ratios single / multi for CPU per token; higher is better, 1 = packing
costs nothing), one line:
RESULT train_cpu_per_token_single_vs_multi=X sample_cpu_per_token_single_vs_multi=X
       train_tok_s_multi_vs_single=X alone_rtt_p50_ms=X
Its ratios are the medians over the rounds; the line before it gives each round's own ratios, whose spread shows
how far this box's speed drifted between phases (either phase's pass has moved by 6-18 % between rounds).

    .venv/bin/python bench/service.py [--quick] [--tenants 8] [--seconds 20] [--rounds 2] [--mode embedded]
                                      [--threads] [--profile FILE]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")  # keep the client's background traffic out of the figures

import httpx  # noqa: E402
import tinker  # noqa: E402
from tinker import types  # noqa: E402

from tests.e2e.server import TINY_MODEL_NAME, Server, start_server  # noqa: E402

PASS_LINE = re.compile(r" pass \S+: (\d+) requests, (\d+) tokens, (\d+) tenants,")
SAMPLE_LINE = re.compile(r" sample batch \S+: (\d+) requests, (\d+) tokens generated")
GROUP_COMMIT_LINE = re.compile(r'^carpool_db_group_commit_(jobs|groups)_total (\S+)$', re.M)
LOOP_CPU_LINE = re.compile(r'^carpool_scheduler_loop_cpu_seconds_total\{[^}]*part="(\w+)"[^}]*\} (\S+)$', re.M)
CLK_TCK = os.sysconf("SC_CLK_TCK")
SETUP_TIMEOUT_S = 300.0
HP = types.AdamParams(learning_rate=1e-4)


# -- the server's CPU time ----------------------------------------------------------------------------
def tree_cpu_seconds(root_pid: int) -> float:
    """utime + stime of `root_pid` and all its descendants (alive ones), in seconds."""
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    tree, frontier = {root_pid}, [root_pid]
    while frontier:
        pid = frontier.pop()
        children = [p for p, parent in parents.items() if parent == pid and p not in tree]
        tree.update(children)
        frontier.extend(children)
    return sum(cpu.get(pid, 0.0) for pid in tree)


def thread_cpu_seconds(pid: int) -> dict[int, float]:
    """utime + stime of each thread of process `pid`, by thread id."""
    out: dict[int, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        out[int(tid)] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def metrics_page(server: Server) -> str:
    """The server's /metrics page, read once per phase boundary for every series taken from it."""
    return httpx.get(f"{server.url}/metrics", timeout=30).text


def loop_cpu_seconds(text: str) -> dict[str, float]:
    """The scheduler loop thread's CPU seconds by part, from a /metrics page (embedded mode: in cluster
    mode the loops run in scheduler processes that this gateway's /metrics does not show)."""
    out: dict[str, float] = {}
    for part, value in LOOP_CPU_LINE.findall(text):
        out[part] = out.get(part, 0.0) + float(value)
    return out


def group_commit_counts(text: str) -> dict[str, float]:
    """The submissions' group commit so far, from a /metrics page: `jobs` and `groups` (empty when the server
    runs without it)."""
    return {name: float(value) for name, value in GROUP_COMMIT_LINE.findall(text)}


def thread_names(pid: int) -> dict[int, str]:
    """Python thread names by native thread id, from `py-spy dump` (3.11 does not name native threads);
    numbered pool threads share one name (`carpool-blocking-N`)."""
    spy = Path(sys.executable).with_name("py-spy")
    if not spy.exists():
        return {}
    text = subprocess.run([str(spy), "dump", "--pid", str(pid), "--nonblocking"], capture_output=True,
                          text=True, timeout=60).stdout
    found = re.finditer(r'^Thread (\d+) \(\w+\): "([^"]*)"', text, re.M)
    return {int(m[1]): re.sub(r"([-_])\d+$", r"\1N", m[2]) for m in found}


# -- one phase ---------------------------------------------------------------------------------------
@dataclass
class Phase:
    name: str
    tokens: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    rtt_ms: dict[str, list[float]] = field(default_factory=dict)
    passes: list[tuple[int, int, int]] = field(default_factory=list)
    """(requests, tokens, tenants) per pass."""
    sample_batches: list[int] = field(default_factory=list)
    threads: dict[str, float] = field(default_factory=dict)
    """Server CPU seconds by thread name (`--threads`): where the service path's time goes."""
    loop_cpu: dict[str, float] = field(default_factory=dict)
    """The scheduler loop thread's CPU seconds by part (`carpool_scheduler_loop_cpu_seconds_total`)."""
    group_commit: dict[str, float] = field(default_factory=dict)
    """Submissions' write transactions (`jobs`) and the transactions they ran in (`groups`) in the phase."""

    @property
    def tok_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def client_calls(self) -> int:
        """Training steps (one fb + optim_step) or sample calls the clients made."""
        return len(self.rtt_ms.get("fb", [])) + len(self.rtt_ms.get("sample", []))

    @property
    def cpu_ms_per_token(self) -> float:
        return 1000 * self.cpu_s / self.tokens if self.tokens else float("nan")

    def rtt(self, kind: str, q: float) -> float:
        values = sorted(self.rtt_ms.get(kind, []))
        return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")

    def row(self) -> str:
        tenants = statistics.mean(p[2] for p in self.passes) if self.passes else 0.0
        tokens = statistics.mean(p[1] for p in self.passes) if self.passes else 0.0
        batch = statistics.mean(self.sample_batches) if self.sample_batches else 0.0
        rtts = "  ".join(f"{k} {self.rtt(k, 0.5):.0f}/{self.rtt(k, 0.95):.0f}" for k in sorted(self.rtt_ms))
        return (f"{self.name:<14} {self.tokens:>7} {self.tok_s:>8.0f} {self.cpu_ms_per_token:>8.3f} "
                f"{len(self.passes):>6} {tenants:>6.2f} {tokens:>7.0f} {batch:>6.2f}  {rtts}")


HEADER = (f"{'phase':<14} {'tokens':>7} {'tok/s':>8} {'cpu_ms/t':>8} {'passes':>6} {'ten/p':>6} {'tok/p':>7} "
          f"{'req/sb':>6}  rtt p50/p95 ms")


class Recorder:
    """Thread-safe token and round-trip accumulation for one phase."""

    def __init__(self, phase: Phase) -> None:
        self.phase = phase
        self._lock = threading.Lock()

    def timed(self, kind: str, call: Callable[[], object]) -> object:
        started = time.perf_counter()
        out = call()
        with self._lock:
            self.phase.rtt_ms.setdefault(kind, []).append((time.perf_counter() - started) * 1000)
        return out

    def add_tokens(self, n: int) -> None:
        with self._lock:
            self.phase.tokens += n


def run_phase(server: Server, name: str, loops: list[Callable[[Recorder, float], None]], seconds: float,
              profile: Path | None = None, threads: bool = False, profile_gil: bool = False) -> Phase:
    """Run every loop on its own thread until `seconds` pass; measure the server meanwhile (and py-spy it
    into `profile`, folded stacks, when given; its CPU per thread with `threads`)."""
    phase = Phase(name)
    spy = None if profile is None else subprocess.Popen(
        [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(server.process.pid), "--format", "raw",
         "--output", str(profile), "--duration", str(max(1, int(seconds))), "--rate", "250", "--threads",
         "--nonblocking", *(["--gil"] if profile_gil else [])], stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    recorder = Recorder(phase)
    log_offset = len(server.log())
    per_thread0 = thread_cpu_seconds(server.process.pid) if threads else {}
    page0 = metrics_page(server)
    loop0, grouped0 = loop_cpu_seconds(page0), group_commit_counts(page0)
    cpu0, started = tree_cpu_seconds(server.process.pid), time.perf_counter()
    deadline = time.monotonic() + seconds
    threads = [threading.Thread(target=loop, args=(recorder, deadline), daemon=True) for loop in loops]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SETUP_TIMEOUT_S)
    phase.wall_s = time.perf_counter() - started
    if spy is not None:
        spy.wait(60)
    phase.cpu_s = tree_cpu_seconds(server.process.pid) - cpu0
    page = metrics_page(server)
    phase.loop_cpu = {part: cpu - loop0.get(part, 0.0) for part, cpu in loop_cpu_seconds(page).items()}
    phase.group_commit = {k: v - grouped0.get(k, 0.0) for k, v in group_commit_counts(page).items()}
    if threads:
        names = thread_names(server.process.pid)
        for tid, cpu in thread_cpu_seconds(server.process.pid).items():
            name = names.get(tid, "MainThread" if tid == server.process.pid else "native")
            phase.threads[name] = phase.threads.get(name, 0.0) + cpu - per_thread0.get(tid, 0.0)
    text = server.log()[log_offset:]
    phase.passes = [(int(a), int(b), int(c)) for a, b, c in PASS_LINE.findall(text)]
    phase.sample_batches = [int(a) for a, _ in SAMPLE_LINE.findall(text)]
    return phase


# -- tenants and their loops ----------------------------------------------------------------------------
@dataclass
class Tenant:
    service: tinker.ServiceClient
    training: tinker.TrainingClient
    sampler: tinker.SamplingClient


def make_tenant(server: Server, name: str, rank: int) -> Tenant:
    service = tinker.ServiceClient(base_url=server.url, api_key=server.create_tenant(name))
    training = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=rank).result(
        timeout=SETUP_TIMEOUT_S)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=SETUP_TIMEOUT_S)
    return Tenant(service, training, sampler)


def datum(i: int, tokens: int, vocab: int) -> types.Datum:
    seq = [(7 + 13 * (i + j)) % (vocab - 1) + 1 for j in range(tokens + 1)]
    return types.Datum(model_input=types.ModelInput.from_ints(seq[:-1]),
                       loss_fn_inputs={"target_tokens": seq[1:], "weights": [1.0] * tokens})


def train_loop(tenant: Tenant, sequences: int, tokens: int, vocab: int) -> Callable[[Recorder, float], None]:
    data = [datum(i, tokens, vocab) for i in range(sequences)]

    def loop(recorder: Recorder, deadline: float) -> None:
        while time.monotonic() < deadline:
            recorder.timed("fb", lambda: tenant.training.forward_backward(data, "cross_entropy").result())
            recorder.timed("optim", lambda: tenant.training.optim_step(HP).result())
            recorder.add_tokens(sequences * tokens)

    return loop


def sample_loop(tenant: Tenant, samples: int, tokens: int) -> Callable[[Recorder, float], None]:
    prompt = types.ModelInput.from_ints([3, 17, 29, 41, 53, 65, 77, 89])
    params = types.SamplingParams(max_tokens=tokens, temperature=1.0)

    def loop(recorder: Recorder, deadline: float) -> None:
        while time.monotonic() < deadline:
            out = recorder.timed("sample", lambda: tenant.sampler.sample(prompt, samples, params).result())
            recorder.add_tokens(sum(len(s.tokens) for s in out.sequences))  # type: ignore[attr-defined]

    return loop


# -- the run -----------------------------------------------------------------------------------------------
def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tenants", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sequence (train) / per sample")
    parser.add_argument("--samples", type=int, default=4, help="samples per request of each tenant")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=20.0, help="length of each measured phase")
    parser.add_argument("--rounds", type=int, default=2, help="all phases this many times, medians reported")
    parser.add_argument("--quick", action="store_true", help="one round of 8 s phases (about 2 minutes)")
    parser.add_argument("--skip-sampling", action="store_true")
    parser.add_argument("--torch-threads", type=int, default=1)
    parser.add_argument("--mode", choices=("embedded", "cluster"), default="embedded")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--env", action="append", default=[], help="KEY=VALUE for the server (repeatable)")
    parser.add_argument("--threads", action="store_true",
                        help="also report the server's CPU per thread (names through py-spy dump) per phase")
    parser.add_argument("--profile", type=Path, default=None,
                        help="py-spy the server during the first round's --profile-phase; folded stacks to this file")
    parser.add_argument("--profile-gil", action="store_true",
                        help="profile only the thread holding the GIL: the server's Python CPU, not its waits")
    parser.add_argument("--profile-phase", default="train_multi",
                        choices=("alone", "train_multi", "train_single", "sample_multi", "sample_single"))
    args = parser.parse_args()
    if args.quick:
        args.seconds, args.rounds = 8.0, 1
    return args


def run_round(server: Server, tenants: list[Tenant], args: argparse.Namespace) -> dict[str, Phase]:
    n, t, vocab, th = args.tenants, args.tokens, args.vocab, args.threads

    def spy(name: str) -> Path | None:
        return args.profile if name == args.profile_phase else None

    phases = {
        "alone": run_phase(server, "alone", [train_loop(tenants[0], 1, t, vocab)], args.seconds / 2, spy("alone"),
                           th, args.profile_gil),
        "train_multi": run_phase(server, "train_multi", [train_loop(x, 1, t, vocab) for x in tenants], args.seconds,
                                 spy("train_multi"), th, args.profile_gil),
        "train_single": run_phase(server, "train_single", [train_loop(tenants[0], n, t, vocab)], args.seconds,
                                  spy("train_single"), th, args.profile_gil),
    }
    if not args.skip_sampling:
        phases["sample_multi"] = run_phase(server, "sample_multi", [sample_loop(x, args.samples, t) for x in tenants],
                                           args.seconds, spy("sample_multi"), th, args.profile_gil)
        phases["sample_single"] = run_phase(server, "sample_single", [sample_loop(tenants[0], n * args.samples, t)],
                                            args.seconds, spy("sample_single"), th, args.profile_gil)
    return phases


def report_threads(rounds: list[dict[str, Phase]]) -> None:
    """Server CPU per request kind's round (one tenant's fb + optim, or one sample call) by thread, ms."""
    print("server CPU ms per client call (train: one fb + optim_step; sample: one sample call) by thread:")
    for i, phases in enumerate(rounds):
        for phase in phases.values():
            calls = phase.client_calls
            if not phase.threads or not calls:
                continue
            parts = sorted(phase.threads.items(), key=lambda kv: -kv[1])
            text = "  ".join(f"{name} {1000 * cpu / calls:.2f}" for name, cpu in parts if cpu > 0)
            print(f"  round {i + 1} {phase.name:<13} {text}")
    print("of it the scheduler loop thread's, by part (carpool_scheduler_loop_cpu_seconds_total), ms per client call:")
    for i, phases in enumerate(rounds):
        for phase in phases.values():
            calls = phase.client_calls
            if phase.loop_cpu and calls:
                text = "  ".join(f"{part} {1000 * cpu / calls:.2f}" for part, cpu in phase.loop_cpu.items() if cpu > 0)
                print(f"  round {i + 1} {phase.name:<13} {text}")
    print("submissions per group-commit transaction (carpool_db_group_commit_jobs_total / groups_total):")
    for i, phases in enumerate(rounds):
        text = "  ".join(f"{p.name} {p.group_commit['jobs'] / p.group_commit['groups']:.2f}"
                         for p in phases.values() if p.group_commit.get("groups"))
        print(f"  round {i + 1} {text or 'group commit off'}")


def ratio(rounds: list[dict[str, Phase]], metric: Callable[[dict[str, Phase]], float]) -> float:
    values = [metric(r) for r in rounds]
    return statistics.median(values) if values else float("nan")


def report(rounds: list[dict[str, Phase]], args: argparse.Namespace) -> None:
    print(HEADER)
    for i, phases in enumerate(rounds):
        print(f"-- round {i + 1}")
        for phase in phases.values():
            print(phase.row())
    if args.threads:
        report_threads(rounds)

    def cpu(single: str, multi: str) -> Callable[[dict[str, Phase]], float]:
        return lambda r: r[single].cpu_ms_per_token / r[multi].cpu_ms_per_token if multi in r else float("nan")

    metrics = {"train CPU": cpu("train_single", "train_multi"), "sample CPU": cpu("sample_single", "sample_multi"),
               "tokens/s": lambda r: r["train_multi"].tok_s / r["train_single"].tok_s}
    # The rounds' own ratios: the box's speed drifts between phases, and the spread says how far to trust the medians.
    print("ratios by round: " + "; ".join(
        f"{name} {', '.join(f'{metric(r):.3f}' for r in rounds)}" for name, metric in metrics.items()))
    train_cpu, sample_cpu, tok_s = (ratio(rounds, metric) for metric in metrics.values())
    alone = ratio(rounds, lambda r: r["alone"].rtt("fb", 0.5))
    print(f"RESULT train_cpu_per_token_single_vs_multi={train_cpu:.3f} "
          f"sample_cpu_per_token_single_vs_multi={sample_cpu:.3f} train_tok_s_multi_vs_single={tok_s:.3f} "
          f"alone_rtt_p50_ms={alone:.1f}")


def main() -> None:
    args = parse_args()
    from worker.models.devmodel import build_dev_model

    env = {"OMP_NUM_THREADS": str(args.torch_threads), **dict(e.split("=", 1) for e in args.env)}
    with tempfile.TemporaryDirectory(prefix="carpool-bench-service-") as tmp:
        model_dir = build_dev_model(Path(tmp) / "model", layers=args.layers, hidden=args.hidden, vocab=args.vocab,
                                    seed=0)
        server = start_server(Path(tmp) / "data", model_dir, extra_env=env, mode=args.mode)
        try:
            tenants = [make_tenant(server, f"bench-tenant-{i}", args.rank) for i in range(args.tenants)]
            for x in tenants:  # warm every path (first passes, first samples) before measuring
                train_loop(x, 1, args.tokens, args.vocab)(Recorder(Phase("warm")), time.monotonic() + 0.1)
            if not args.skip_sampling:
                run_phase(server, "warm", [sample_loop(x, args.samples, args.tokens) for x in tenants], 1.0)
            rounds = []
            for _ in range(args.rounds):
                rounds.append(run_round(server, tenants, args))
                args.profile = None
            for x in tenants:
                x.service.holder.close()
        finally:
            server.stop()
    report(rounds, args)


if __name__ == "__main__":
    main()
