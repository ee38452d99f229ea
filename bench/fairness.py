"""Fairness benchmark: a light tenant's wait beside a heavy tenant that sends ten times its tokens.

Runs the real service core in one process (SQLite, in-memory queue, `SchedulerLoop` thread, the packed
`Engine` on a random-weight dev model, `ServiceControlPlane`) and drives it like SDK clients do: each
training client submits `forward_backward` then `optim_step` (pipelined) and waits for both, in a loop.

    tenant B  one model, `--b-tokens` tokens per forward_backward, one step at a time (closed loop)
    tenant A  `--a-models` models, each sending `--ratio` x B's tokens per step, back to back (so A
              always has work queued and fills every pass B is not in)

Phases, in one process: B alone, A alone, then A and B together. B's wait is the time from submitting
its forward_backward to holding the result (what a user sees as latency). The last line is
machine-readable: RESULT b_wait_ratio=X a_tokens_per_s=X (ratio = B's median wait under contention over
B's median wait alone; A's throughput measured during the contention phase).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

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
from services.domain.training import AdamParams, Datum, ForwardBackwardWork, LoraSpec  # noqa: E402
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue  # noqa: E402
from services.runtime import LoopConfig, SchedulerLoop  # noqa: E402
from services.scheduler import Scheduler, SchedulerLimits  # noqa: E402
from services.storage import LocalCheckpointStore, UrlSigner  # noqa: E402

BASE = "bench-base"
HP = AdamParams(learning_rate=1e-4)


@dataclass
class Service:
    control: ServiceControlPlane
    loop: SchedulerLoop
    db: Database


@dataclass
class Trainer:
    """One training client: a model and its next seq id."""

    tenant: Tenant
    model_id: ModelId
    tokens: int
    next_seq: int = 1
    waits_s: list[float] = field(default_factory=list)
    tokens_done: int = 0


def build_service(model_dir: Path, data_dir: Path, args: argparse.Namespace) -> Service:
    from worker.engine.engine import Engine, EngineConfig

    db = open_database(database_url_for_data_dir(data_dir), migrate=True)
    engine = Engine(model_dir, name=BASE, config=EngineConfig(device=args.device, dtype=args.dtype,
                                                              max_tokens_per_pass=args.engine_pass_tokens))
    queue, results, notifier = InMemoryWorkQueue(), InMemoryResultStore(), InMemoryNotifier()
    limits = SchedulerLimits(max_tokens_per_pass=args.max_tokens_per_pass, quantum_tokens=args.quantum)
    loop = SchedulerLoop(BASE, engine, queue, results, notifier, scheduler=Scheduler(limits),
                         hook=DatabaseCompletionHook(db),
                         config=LoopConfig(batch_window_s=args.batch_window_ms / 1000))
    served = ServedModel(engine.info, engine.limits, queue=BASE, max_tokens_per_request=args.max_tokens_per_pass,
                         stats=loop.stats)
    store = LocalCheckpointStore(data_dir / "checkpoints", UrlSigner(b"bench-only-url-signing-secret..."))
    control = ServiceControlPlane(db, queue, results, notifier, store, [served],
                                  ControlOptions(scratch_dir=data_dir / "scratch"))
    loop.start()
    return Service(control, loop, db)


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
    name: str
    b_waits_s: list[float]
    a_tokens: int
    seconds: float

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


async def phase(control: ServiceControlPlane, name: str, a: list[Trainer], b: Trainer | None,
                args: argparse.Namespace, vocab: int) -> PhaseResult:
    rng = np.random.default_rng(0)
    a_work = make_work(rng, vocab, args.b_tokens * args.ratio, args.seq_len)
    b_work = make_work(rng, vocab, args.b_tokens, args.seq_len)
    for trainer in [*a, *([b] if b else [])]:
        trainer.waits_s.clear()
        trainer.tokens_done = 0
    stop = asyncio.Event()
    a_tasks = [asyncio.create_task(run_until(control, t, stop, a_work)) for t in a]
    await asyncio.sleep(args.warmup_s if a else 0.0)  # A's backlog builds up before B starts measuring
    started = time.perf_counter()
    a_before = sum(t.tokens_done for t in a)
    if b is not None:
        await run_steps(control, b, args.b_steps, b_work)
    else:
        await asyncio.sleep(args.a_alone_s)
    seconds = time.perf_counter() - started
    a_tokens = sum(t.tokens_done for t in a) - a_before
    stop.set()
    await asyncio.gather(*a_tasks)
    return PhaseResult(name, list(b.waits_s) if b else [], a_tokens, seconds)


async def run(service: Service, args: argparse.Namespace, vocab: int) -> list[PhaseResult]:
    control = service.control
    with service.db.sessions.begin() as db:
        tenant_a = create_tenant_with_key(db, "heavy-a")[0]
        tenant_b = create_tenant_with_key(db, "light-b")[0]
    session_a = await control.create_session(tenant_a, tags=[], user_metadata={}, sdk_version=None, project_id=None)
    session_b = await control.create_session(tenant_b, tags=[], user_metadata={}, sdk_version=None, project_id=None)
    a = [await new_trainer(control, tenant_a, session_a, k, args.b_tokens * args.ratio) for k in range(args.a_models)]
    b = await new_trainer(control, tenant_b, session_b, 0, args.b_tokens)
    await phase(control, "warmup", [], b, argparse.Namespace(**{**vars(args), "b_steps": 3}), vocab)
    results = [await phase(control, "B alone", [], b, args, vocab),
               await phase(control, "A alone", a, None, args, vocab),
               await phase(control, "A + B", a, b, args, vocab)]
    return results


def report(results: list[PhaseResult], stats_line: str) -> None:
    print(f"{'phase':<10} {'B median wait':>14} {'B p90 wait':>11} {'B steps':>8} {'A tokens/s':>11}")
    for r in results:
        b_median = f"{r.b_median_ms:.1f} ms" if r.b_waits_s else "-"
        b_p90 = f"{r.b_p90_ms:.1f} ms" if r.b_waits_s else "-"
        a_rate = f"{r.a_tokens_per_s:.0f}" if r.a_tokens else "-"
        print(f"{r.name:<10} {b_median:>14} {b_p90:>11} {len(r.b_waits_s):>8} {a_rate:>11}")
    print(stats_line)
    alone, contended = results[0], results[2]
    ratio = contended.b_median_ms / alone.b_median_ms
    print(f"RESULT b_wait_ratio={ratio:.2f} a_tokens_per_s={contended.a_tokens_per_s:.0f}")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=256, help="dev model hidden size")
    parser.add_argument("--layers", type=int, default=4, help="dev model layers")
    parser.add_argument("--model-dir", type=Path, default=None, help="serve this model instead of a dev model")
    parser.add_argument("--b-tokens", type=int, default=64, help="tokens of B's forward_backward")
    parser.add_argument("--ratio", type=int, default=10, help="A's tokens per request over B's")
    parser.add_argument("--a-models", type=int, default=4, help="A's models, each training back to back")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per datum")
    parser.add_argument("--b-steps", type=int, default=30, help="B's measured steps per phase")
    parser.add_argument("--a-alone-s", type=float, default=10.0, help="length of the A-alone phase")
    parser.add_argument("--warmup-s", type=float, default=2.0, help="A runs this long before B measures")
    parser.add_argument("--max-tokens-per-pass", type=int, default=32768, help="scheduler pass budget")
    parser.add_argument("--engine-pass-tokens", type=int, default=8192, help="engine micro-batch budget")
    parser.add_argument("--quantum", type=int, default=SchedulerLimits().quantum_tokens)
    parser.add_argument("--batch-window-ms", type=float, default=5.0)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    return parser.parse_args()


def main() -> None:
    import logging

    logging.basicConfig(level=logging.WARNING)
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model_dir
        if model_dir is None:
            from worker.models.devmodel import build_dev_model

            model_dir = build_dev_model(Path(tmp) / "model", layers=args.layers, hidden=args.hidden, vocab=2048,
                                        seed=0)
        service = build_service(model_dir, Path(tmp) / "data", args)
        vocab = service.control.base_models()[0].vocab_size
        try:
            results = asyncio.run(run(service, args, vocab))
            stats = service.loop.stats()
            stats_line = (f"passes {stats.passes}, mean tenants/pass {stats.mean_tenants_per_pass:.2f}, "
                          f"tokens {stats.tokens}, busy {stats.busy_seconds:.1f} s")
        finally:
            service.loop.stop()
            service.db.dispose()
        report(results, stats_line)


if __name__ == "__main__":
    main()
