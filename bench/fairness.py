"""Fairness benchmark: a light tenant's wait beside a heavy tenant that sends ten times its tokens.

Runs the real service core in one process (SQLite, in-memory queue, `SchedulerLoop` thread, the packed
`Engine` on a random-weight dev model, `ServiceControlPlane`) and drives it like SDK clients do: each
training client submits `forward_backward` then `optim_step` (pipelined) and waits for both, in a loop.

    tenant B  one model, `--b-tokens` tokens per forward_backward, one step at a time (closed loop)
    tenant A  `--a-models` models, together sending `--ratio` x B's tokens per step, each model back to
              back (so A always has work queued and fills every pass B is not in)

Phases: B alone, A alone, then A and B together, for several scheduler configurations side by side (each
its own service in this process, rounds interleaved so drift on a shared machine hits all alike): the
service's default (`SchedulerLimits()`: latency-fair pacing, `CARPOOL_PASS_LATENCY_FACTOR`), each of
`--factors` (0: pacing off, passes fill the token budget), and with `--max-pass-ms` an explicit pass target
(`CARPOOL_MAX_PASS_MS`). B's wait is the time from submitting its forward_backward to holding the result
(what a user sees as latency). Per phase the report also shows B's and A's throughput, the mean pass
(duration, tokens) and barrier (duration, count per pass), and the share of the loop's item time spent in
the engine and in the request log (completion hook DB writes): where the fixed per-item cost that small
passes pay more often comes from. The last line is machine-readable, for the default configuration:
RESULT b_wait_ratio=X a_tokens_per_s=X b_wait_ratio_round_median=X (ratio = B's median wait beside A over
B's median wait alone, over all rounds; A's throughput while B trains beside it; the median over rounds of
each round's own ratio, which a machine whose speed drifts between rounds moves less).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from services.auth.tenants import Tenant, create_tenant_with_key  # noqa: E402
from services.control.api import Done, Failed, Pending, Submitted  # noqa: E402
from services.control.context import ControlOptions  # noqa: E402
from services.control.plane import ServiceControlPlane  # noqa: E402
from services.control.recording import DatabaseCompletionHook  # noqa: E402
from services.control.registry import ServedModel  # noqa: E402
from services.db import Database, database_url_for_data_dir, open_database  # noqa: E402
from services.db.ids import ModelId, RequestId, SessionId  # noqa: E402
from services.domain.training import AdamParams, Datum, ForwardBackwardWork, LoraSpec, WorkError  # noqa: E402
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue  # noqa: E402
from services.runtime import LoopConfig, SchedulerLoop  # noqa: E402
from services.scheduler import BarrierPlan, PassPlan, PlanItem, Scheduler, SchedulerLimits, StepPlan  # noqa: E402
from services.scheduler.scheduler import CONTENTION_WINDOW_S  # noqa: E402
from services.storage import LocalCheckpointStore, UrlSigner  # noqa: E402

BASE = "bench-base"
HP = AdamParams(learning_rate=1e-4)


class TimedScheduler(Scheduler):
    """The scheduler under test, also recording how long each plan item ran (the loop runs a step's items
    one by one, so an item's time runs from the step or the previous item's completion to its own)."""

    def __init__(self, limits: SchedulerLimits) -> None:
        super().__init__(limits)
        self.items: list[tuple[str, int, float]] = []
        """(kind, tokens, seconds) per completed item; the bench clears it per phase."""
        self._mark = 0.0

    def step(self) -> StepPlan:
        plan = super().step()
        self._mark = time.perf_counter()
        return plan

    def complete(self, item: PlanItem, results: Sequence[object] | WorkError) -> Any:
        now = time.perf_counter()
        kind = "pass" if isinstance(item, PassPlan) else "barrier" if isinstance(item, BarrierPlan) else "sample"
        self.items.append((kind, item.num_tokens if isinstance(item, PassPlan) else 0, now - self._mark))
        self._mark = now
        return super().complete(item, results)


@dataclass
class Timers:
    """Where the loop's time went, per phase: engine work calls and the request-log hook (DB writes)."""

    engine_s: float = 0.0
    hook_s: float = 0.0

    def timed(self, attribute: str, call: Any) -> Any:
        def run(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                setattr(self, attribute, getattr(self, attribute) + time.perf_counter() - started)
        return run


class TimedEngine:
    """The engine, with the time of its work calls added to `timers.engine_s`."""

    WORK = frozenset({"forward_backward", "optim_step", "sample"})

    def __init__(self, engine: Any, timers: Timers) -> None:
        self._engine, self._timers = engine, timers

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._engine, name)
        return self._timers.timed("engine_s", attribute) if name in self.WORK else attribute


class TimedHook:
    """The completion hook, with its time added to `timers.hook_s`."""

    def __init__(self, hook: DatabaseCompletionHook, timers: Timers) -> None:
        self.started = timers.timed("hook_s", hook.started)
        self.finished = timers.timed("hook_s", hook.finished)


@dataclass
class Service:
    control: ServiceControlPlane
    loop: SchedulerLoop
    db: Database
    scheduler: TimedScheduler
    timers: Timers


@dataclass
class Trainer:
    """One training client: a model and its next seq id."""

    tenant: Tenant
    model_id: ModelId
    tokens: int
    next_seq: int = 1
    waits_s: list[float] = field(default_factory=list)
    tokens_done: int = 0


def build_service(model_dir: Path, data_dir: Path, args: argparse.Namespace, limits: SchedulerLimits) -> Service:
    from worker.engine.engine import Engine, EngineConfig

    db = open_database(database_url_for_data_dir(data_dir), migrate=True)
    engine = Engine(model_dir, name=BASE, config=EngineConfig(device=args.device, dtype=args.dtype,
                                                              max_tokens_per_pass=args.engine_pass_tokens))
    queue, results, notifier = InMemoryWorkQueue(), InMemoryResultStore(), InMemoryNotifier()
    scheduler, timers = TimedScheduler(limits), Timers()
    loop = SchedulerLoop(BASE, TimedEngine(engine, timers), queue, results, notifier, scheduler=scheduler,
                         hook=TimedHook(DatabaseCompletionHook(db), timers),
                         config=LoopConfig(batch_window_s=args.batch_window_ms / 1000))
    served = ServedModel(engine.info, engine.limits, queue=BASE, max_tokens_per_request=args.max_tokens_per_pass,
                         stats=loop.stats)
    store = LocalCheckpointStore(data_dir / "checkpoints", UrlSigner(b"bench-only-url-signing-secret..."))
    control = ServiceControlPlane(db, queue, results, notifier, store, [served],
                                  ControlOptions(scratch_dir=data_dir / "scratch"))
    loop.start()
    return Service(control, loop, db, scheduler, timers)


async def wait_done(control: ServiceControlPlane, tenant: Tenant, request_id: RequestId) -> object:
    while True:
        state = await control.retrieve(tenant, request_id, 30.0)
        if isinstance(state, Pending):
            continue
        if isinstance(state, Failed):
            raise RuntimeError(f"request {request_id} failed: {state.error}")
        assert isinstance(state, Done)
        return state.result


async def new_trainer(control: ServiceControlPlane, tenant: Tenant, session: SessionId, k: int,
                      tokens: int) -> Trainer:
    created: Submitted = await control.create_model(tenant, session, k, BASE, LoraSpec(rank=8), None)
    await wait_done(control, tenant, created.request_id)
    assert created.model_id is not None
    return Trainer(tenant, created.model_id, tokens)


async def train_step(control: ServiceControlPlane, trainer: Trainer, work: ForwardBackwardWork) -> None:
    """forward_backward + optim_step submitted back to back (as the SDK pipelines them); waits for both."""
    started = time.perf_counter()
    fb = await control.forward_backward(trainer.tenant, trainer.model_id, trainer.next_seq, work)
    optim = await control.optim_step(trainer.tenant, trainer.model_id, trainer.next_seq + 1, HP)
    trainer.next_seq += 2
    await wait_done(control, trainer.tenant, fb.request_id)
    trainer.waits_s.append(time.perf_counter() - started)
    await wait_done(control, trainer.tenant, optim.request_id)
    trainer.tokens_done += trainer.tokens


def make_work(rng: np.random.Generator, vocab: int, tokens: int, seq_len: int) -> ForwardBackwardWork:
    data = []
    for n in _split(tokens, seq_len):
        seq = rng.integers(0, vocab, n + 1)
        data.append(Datum(seq[:-1].astype(np.int64), {"target_tokens": seq[1:].astype(np.int64),
                                                      "weights": np.ones(n, np.float32)}))
    return ForwardBackwardWork(None, data)  # the control plane sets each request's adapter


def _split(tokens: int, seq_len: int) -> list[int]:
    full, rest = divmod(tokens, seq_len)
    return [seq_len] * full + ([rest] if rest else [])


async def run_steps(control: ServiceControlPlane, trainer: Trainer, steps: int, work: ForwardBackwardWork) -> None:
    for _ in range(steps):
        await train_step(control, trainer, work)


async def run_until(control: ServiceControlPlane, trainer: Trainer, stop: asyncio.Event,
                    work: ForwardBackwardWork) -> None:
    while not stop.is_set():
        await train_step(control, trainer, work)


@dataclass
class PhaseResult:
    """One kind of phase, summed over its rounds."""

    name: str
    a_tokens: int = 0
    seconds: float = 0.0
    items: list[tuple[str, int, float]] = field(default_factory=list)
    """(kind, tokens, seconds) of the plan items run while measuring."""
    engine_s: float = 0.0
    hook_s: float = 0.0
    b_waits_by_round: list[list[float]] = field(default_factory=list)
    """B's waits of each round on its own (a round's phases run back to back, minutes apart from the next)."""

    @property
    def b_waits_s(self) -> list[float]:
        """B's waits of every round."""
        return [wait for waits in self.b_waits_by_round for wait in waits]

    def item_summary(self) -> str:
        passes = [(n, s) for kind, n, s in self.items if kind == "pass"]
        barriers = [s for kind, _, s in self.items if kind == "barrier"]
        if not passes:
            return "-"
        pass_ms = statistics.mean(s for _, s in passes) * 1000
        tokens = statistics.mean(n for n, _ in passes)
        barrier_ms = statistics.mean(barriers) * 1000 if barriers else 0.0
        total_s = sum(s for _, _, s in self.items)
        return (f"pass {pass_ms:.0f} ms/{tokens:.0f} tok, barrier {barrier_ms:.0f} ms x "
                f"{len(barriers) / len(passes):.1f}/pass; engine {self.engine_s / total_s:.0%}, "
                f"request log {self.hook_s / total_s:.0%} of item time")

    @property
    def b_median_ms(self) -> float:
        return statistics.median(self.b_waits_s) * 1000 if self.b_waits_s else float("nan")

    @property
    def b_p90_ms(self) -> float:
        if len(self.b_waits_s) < 2:
            return self.b_median_ms
        return statistics.quantiles(self.b_waits_s, n=10)[-1] * 1000

    @property
    def a_tokens_per_s(self) -> float:
        return self.a_tokens / self.seconds if self.seconds else 0.0


@dataclass
class Workload:
    a: list[Trainer]
    b: Trainer
    a_work: ForwardBackwardWork
    b_work: ForwardBackwardWork


async def phase(service: Service, into: PhaseResult, load: Workload, *, with_a: bool,
                with_b: bool, args: argparse.Namespace) -> None:
    """Run one round of a phase and add what it measured to `into`."""
    control = service.control
    a = load.a if with_a else []
    for trainer in [*a, load.b]:
        trainer.waits_s.clear()
        trainer.tokens_done = 0
    stop = asyncio.Event()
    a_tasks = [asyncio.create_task(run_until(control, t, stop, load.a_work)) for t in a]
    # A's backlog builds up before B starts measuring; alone, A also waits out the scheduler's contention
    # window, or passes would still be paced for B's earlier phase.
    await asyncio.sleep(0.0 if not a else args.warmup_s if with_b else max(args.warmup_s, CONTENTION_WINDOW_S + 1))
    started = time.perf_counter()
    service.scheduler.items.clear()
    service.timers.engine_s = service.timers.hook_s = 0.0
    a_before = sum(t.tokens_done for t in a)
    if with_b:
        await run_steps(control, load.b, args.b_steps, load.b_work)
    else:
        await asyncio.sleep(args.a_alone_s)
    into.seconds += time.perf_counter() - started
    into.items += service.scheduler.items
    into.engine_s += service.timers.engine_s
    into.hook_s += service.timers.hook_s
    into.a_tokens += sum(t.tokens_done for t in a) - a_before
    stop.set()
    await asyncio.gather(*a_tasks)
    if with_b:
        into.b_waits_by_round.append(list(load.b.waits_s))


@dataclass
class Variant:
    """One scheduler configuration under test: its own service, clients and results."""

    name: str
    service: Service
    load: Workload
    results: list[PhaseResult]

    @property
    def b_wait_ratio(self) -> float:
        return self.results[2].b_median_ms / self.results[0].b_median_ms

    @property
    def round_ratios(self) -> list[float]:
        """B's median wait beside A over its median wait alone, round by round: each against the B-alone
        phase just before it, so that a machine whose speed drifts between rounds compares like with like."""
        return [statistics.median(shared) / statistics.median(alone)
                for alone, shared in zip(self.results[0].b_waits_by_round, self.results[2].b_waits_by_round,
                                         strict=True)]

    @property
    def a_tokens_per_s(self) -> float:
        return self.results[2].a_tokens_per_s


async def prepare(name: str, service: Service, args: argparse.Namespace) -> Variant:
    """Tenants, sessions and models of one variant, and a few warm-up steps."""
    control = service.control
    vocab = control.base_models()[0].vocab_size
    with service.db.sessions.begin() as db:
        tenant_a = create_tenant_with_key(db, "heavy-a")[0]
        tenant_b = create_tenant_with_key(db, "light-b")[0]
    session_a = await control.create_session(tenant_a, tags=[], user_metadata={}, sdk_version=None, project_id=None)
    session_b = await control.create_session(tenant_b, tags=[], user_metadata={}, sdk_version=None, project_id=None)
    a_tokens = args.b_tokens * args.ratio // args.a_models
    a = [await new_trainer(control, tenant_a, session_a, k, a_tokens) for k in range(args.a_models)]
    b = await new_trainer(control, tenant_b, session_b, 0, args.b_tokens)
    rng = np.random.default_rng(0)
    load = Workload(a, b, make_work(rng, vocab, a_tokens, args.seq_len),
                    make_work(rng, vocab, args.b_tokens, args.seq_len))
    await run_steps(control, b, 3, load.b_work)  # warm-up: first passes allocate
    return Variant(name, service, load, [PhaseResult("B alone"), PhaseResult("A alone"), PhaseResult("A + B")])


async def run(variants: list[tuple[str, Service]], args: argparse.Namespace) -> list[Variant]:
    """B alone, A alone, A + B for every variant, in `args.rounds` interleaved rounds (drift on a shared
    machine hits every phase and variant alike)."""
    prepared = [await prepare(name, service, args) for name, service in variants]
    for _ in range(args.rounds):
        for v in prepared:
            service, results = v.service, v.results
            await phase(service, results[0], v.load, with_a=False, with_b=True, args=args)
            await phase(service, results[1], v.load, with_a=True, with_b=False, args=args)
            await phase(service, results[2], v.load, with_a=True, with_b=True, args=args)
    return prepared


def report(variants: list[Variant], args: argparse.Namespace) -> None:
    a_tokens = args.b_tokens * args.ratio // args.a_models
    print(f"B: 1 model x {args.b_tokens} tokens/step; A: {args.a_models} models x {a_tokens} tokens/step "
          f"({args.ratio}x B's tokens); scheduler budget {args.max_tokens_per_pass} tokens; {args.rounds} rounds")
    print(f"{'scheduler':<22} {'phase':<8} {'B median':>9} {'B p90':>9} {'B steps':>8} {'A tokens/s':>11} "
          f"{'B tokens/s':>11}  items")
    for v in variants:
        for r in v.results:
            b_median = f"{r.b_median_ms:.0f} ms" if r.b_waits_s else "-"
            b_p90 = f"{r.b_p90_ms:.0f} ms" if r.b_waits_s else "-"
            a_rate = f"{r.a_tokens_per_s:.0f}" if r.a_tokens else "-"
            b_rate = f"{len(r.b_waits_s) * args.b_tokens / r.seconds:.0f}" if r.b_waits_s else "-"
            print(f"{v.name:<22} {r.name:<8} {b_median:>9} {b_p90:>9} {len(r.b_waits_s):>8} {a_rate:>11} {b_rate:>11}  "
                  f"{r.item_summary()}")
        stats = v.service.loop.stats()
        rounds = ", ".join(f"{r:.2f}" for r in v.round_ratios)
        print(f"{v.name:<22} b_wait_ratio {v.b_wait_ratio:.2f} (by round: {rounds}); passes {stats.passes}, "
              f"mean tokens/pass {stats.tokens / max(1, stats.passes):.0f}, mean tenants/pass "
              f"{stats.mean_tenants_per_pass:.2f}")
    default = variants[0]  # the service's default configuration
    print(f"RESULT b_wait_ratio={default.b_wait_ratio:.2f} a_tokens_per_s={default.a_tokens_per_s:.0f} "
          f"b_wait_ratio_round_median={statistics.median(default.round_ratios):.2f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256, help="dev model hidden size")
    parser.add_argument("--layers", type=int, default=4, help="dev model layers")
    parser.add_argument("--model-dir", type=Path, default=None, help="serve this model instead of a dev model")
    parser.add_argument("--b-tokens", type=int, default=64, help="tokens of B's forward_backward")
    parser.add_argument("--ratio", type=int, default=10, help="A's tokens per request over B's")
    parser.add_argument("--a-models", type=int, default=10,
                        help="A's models, each training back to back; A's tokens are split among them")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per datum")
    parser.add_argument("--b-steps", type=int, default=30,
                        help="B's measured steps per phase and round (10 until 2026-12-05: a round's median of "
                        "10 waits moved by 0.3 from round to round)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of the three phases")
    parser.add_argument("--a-alone-s", type=float, default=4.0, help="length of an A-alone round")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="A runs this long before B measures")
    parser.add_argument("--max-tokens-per-pass", type=int, default=32768, help="scheduler pass budget")
    parser.add_argument("--engine-pass-tokens", type=int, default=8192, help="engine micro-batch budget")
    parser.add_argument("--quantum", type=int, default=SchedulerLimits().quantum_tokens)
    parser.add_argument("--factors", default="0",
                        help="comma-separated pass_latency_factor variants run beside the default (0: pacing off; "
                        "empty: the default only)")
    parser.add_argument("--max-pass-ms", type=float, default=0.0,
                        help="also run a variant with this explicit pass target (CARPOOL_MAX_PASS_MS); 0: none")
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    return parser.parse_args()


def variant_limits(args: argparse.Namespace) -> list[tuple[str, SchedulerLimits]]:
    """The default configuration first (the RESULT line's), then the variants asked for."""
    base = SchedulerLimits(max_tokens_per_pass=args.max_tokens_per_pass, quantum_tokens=args.quantum)
    configs = [(f"default (factor {base.pass_latency_factor:.3g})", base)]
    for factor in (float(f) for f in args.factors.split(",") if f.strip()):
        configs.append((f"factor={factor:g}" + (" (off)" if factor == 0 else ""),
                        replace(base, pass_latency_factor=factor)))
    if args.max_pass_ms > 0:
        configs.append((f"max_pass_ms={args.max_pass_ms:g}", replace(base, max_pass_seconds=args.max_pass_ms / 1000)))
    return configs


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    args = parse_args()
    configs = variant_limits(args)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from worker.models.devmodel import build_dev_model

            model_dir = build_dev_model(Path(tmp) / "model", layers=args.layers, hidden=args.hidden, vocab=2048,
                                        seed=0)
        services = [(name, build_service(model_dir, Path(tmp) / f"data-{i}", args, limits))
                    for i, (name, limits) in enumerate(configs)]
        try:
            variants = asyncio.run(run(services, args))
        finally:
            for _, service in services:
                service.loop.stop()
                service.db.dispose()
        report(variants, args)


if __name__ == "__main__":
    main()
