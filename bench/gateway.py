"""Gateway benchmark: what the HTTP edge and the control plane add on top of the engine, and whether idle
long-polls slow other tenants down.

Starts `carpool serve` (a subprocess on 127.0.0.1, `tests/e2e/server.py`) on a tiny random-weight Qwen3
(2 layers, hidden 64, vocab 512, as the e2e suites use) and measures:

  (a) forward_backward round trip through the unmodified SDK (`training_client.forward_backward(...).result()`)
      vs. the engine called directly in this process (`Engine(...).forward_backward`) on the same model and
      data. The two alternate in blocks (a pause before each) so drift hits both alike. Overhead quantile
      q = quantile_q(SDK round trip) - median(engine); the engine's own spread is shown too, and so is the
      same pass's time inside the server (from its log), which splits the overhead into "the engine runs
      slower in the server" and everything outside the engine.
  (b) another tenant's `session_heartbeat` latency, first with the server idle, then with 500 idle long-polls
      held open: an "idler" tenant creates a model and submits 500 `optim_step`s with seq ids 2..501 but never
      seq 1, so every one of them legitimately stays queued, and long-polls all 500 of its own request ids
      with raw httpx from a child process (re-polling on `try_again`, like the SDK). The heartbeats are
      timed for longer than the server's long-poll (25 s), so the moment the 500 time out and re-poll (within
      a few seconds of each other) is included.

Both processes run torch with `--torch-threads` intra-op threads (default 1, set in this process and passed
to the server as OMP_NUM_THREADS): on a shared 2-core machine two-thread OpenMP passes stall whenever a core is
busy elsewhere (a tiny-model pass went from ~8 ms to ~90 ms under load), which would bury the gateway's
share in engine noise. The overhead is a difference of two runs of the same engine, so this is fair to both.

Everything talks to 127.0.0.1 only, every loop is bounded and the server is stopped at the end. Prints a
table; the last line is machine-readable:
RESULT gateway_overhead_p50_ms=X gateway_overhead_p95_ms=X heartbeat_p50_ms=X heartbeat_p95_ms=X

    .venv/bin/python bench/gateway.py [--iterations 200] [--heartbeat-seconds 35] [--long-polls 500]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")  # keep the client's background traffic out of the timings

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from services.domain.training import AdapterId, Datum, ForwardBackwardWork, LoraSpec  # noqa: E402
from tests.e2e.server import TINY_MODEL_NAME, Server, start_server  # noqa: E402
from worker.engine.engine import Engine, EngineConfig  # noqa: E402
from worker.models.devmodel import build_dev_model  # noqa: E402

RANK = 4
TOKENS = [1, 5, 9, 13, 17, 21, 25, 29, 33, 37, 41, 45, 49, 53, 57, 61, 65]
"""One 16-token sequence (input = TOKENS[:-1], targets = TOKENS[1:])."""
SETUP_TIMEOUT_S = 120.0
BLOCKS = 5
"""(a) alternates engine and SDK calls in this many blocks each."""
PASS_LINE = re.compile(r" pass \S+: 1 requests, \d+ tokens, .*?, ([\d.]+) ms,")
"""`services.runtime.dispatch`'s log line of a packed pass with one request."""
SETTLE_S = 0.5
"""Pause before each block (longer than OpenMP's spin-wait after a pass)."""


# -- statistics ---------------------------------------------------------------------------------------
def quantile(values: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(values), q))


@dataclass
class Series:
    """Latencies in milliseconds."""

    name: str
    ms: list[float] = field(default_factory=list)

    def row(self) -> str:
        return (f"{self.name:<44} {len(self.ms):>5} {quantile(self.ms, 0.5):>9.2f} {quantile(self.ms, 0.95):>9.2f} "
                f"{max(self.ms):>9.2f}")


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return (time.perf_counter() - started) * 1000


# -- (a) forward_backward: SDK round trip vs. the engine ------------------------------------------------
def engine_call(model_dir: Path) -> Callable[[], object]:
    """A direct `Engine.forward_backward` on the same model, rank and datum the SDK sends."""
    engine = Engine(model_dir, name=TINY_MODEL_NAME, config=EngineConfig(device="cpu"))
    adapter = AdapterId("bench-direct")
    engine.create_adapter(adapter, LoraSpec(rank=RANK))
    n = len(TOKENS) - 1
    work = ForwardBackwardWork(
        adapter_id=adapter,
        data=[Datum(tokens=np.asarray(TOKENS[:-1], dtype=np.int64), loss_inputs={
            "target_tokens": np.asarray(TOKENS[1:], dtype=np.int64), "weights": np.ones(n, dtype=np.float32)})],
        loss_fn="cross_entropy",
        loss_config={},
        forward_only=False,
    )

    def call() -> object:
        (result,) = engine.forward_backward([work])
        assert not hasattr(result, "message"), result  # a WorkError has a message
        return result

    return call


def sdk_call(server: Server) -> tuple[Callable[[], object], tinker.ServiceClient]:
    service = tinker.ServiceClient(base_url=server.url, api_key=server.create_tenant("bench-sdk"))
    training = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=RANK).result(
        timeout=SETUP_TIMEOUT_S)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )

    def call() -> object:
        out = training.forward_backward([datum], "cross_entropy").result(timeout=60)
        assert out.metrics["loss:sum"] > 0
        return out

    return call, service


def measure_overhead(server: Server, model_dir: Path, iterations: int) -> list[Series]:
    direct = engine_call(model_dir)
    through_sdk, service = sdk_call(server)
    try:
        for _ in range(10):  # warm both paths (allocator, caches, connection pool)
            direct()
            through_sdk()
        log_offset = len(server.log())
        engine_ms, sdk_ms = Series("engine.forward_backward (direct)"), Series("SDK forward_backward().result()")
        # Alternate in blocks, with a pause between: torch's OpenMP threads spin-wait for a while after a
        # pass, and on two cores the spinning of one process (this one or the server) would otherwise be
        # billed to the other's next call.
        block = max(1, iterations // BLOCKS)
        for start in range(0, iterations, block):
            for series, call in ((engine_ms, direct), (sdk_ms, through_sdk)):
                time.sleep(SETTLE_S)
                call()  # first call after the switch: not timed
                for _ in range(min(block, iterations - start)):
                    series.ms.append(timed(call))
    finally:
        service.holder.close()
    base = statistics.median(engine_ms.ms)
    overhead = Series("overhead = SDK - median(engine)", [ms - base for ms in sdk_ms.ms])
    # The server logs each pass's engine time: the same engine call, but inside the server process.
    in_server = Series("  engine pass inside the server (its log)",
                       [float(ms) for ms in PASS_LINE.findall(server.log()[log_offset:])])
    outside = Series("  SDK - median(pass inside the server)",
                     [ms - statistics.median(in_server.ms) for ms in sdk_ms.ms] if in_server.ms else [0.0])
    return [engine_ms, sdk_ms, overhead, in_server, outside]


# -- (b) heartbeats while 500 long-polls are held ---------------------------------------------------------
def new_session(client: httpx.Client) -> str:
    answer = client.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    answer.raise_for_status()
    return str(answer.json()["session_id"])


def heartbeats(server: Server, key: str, name: str, *, count: int = 0, seconds: float = 0.0) -> Series:
    """Sequential heartbeats of one tenant's session, `count` of them or for `seconds` (10 ms apart)."""
    with httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=10) as client:
        session = new_session(client)
        body = {"session_id": session, "type": "session_heartbeat"}
        for _ in range(5):
            client.post("/api/v1/session_heartbeat", json=body).raise_for_status()
        series = Series(name)
        deadline = time.monotonic() + seconds
        while len(series.ms) < max(count, 1) or time.monotonic() < deadline:
            started = time.perf_counter()
            answer = client.post("/api/v1/session_heartbeat", json=body)
            series.ms.append((time.perf_counter() - started) * 1000)
            answer.raise_for_status()
            time.sleep(0.01)
    return series


def queue_stuck_requests(server: Server, key: str, count: int) -> list[str]:
    """`count` of the idler's own requests that stay pending: optim_steps 2..count+1 of a model whose seq 1
    is never sent (the model runs its requests strictly in seq order)."""
    with httpx.Client(base_url=server.url, headers={"X-API-Key": key}, timeout=30) as client:
        session = new_session(client)
        created = client.post("/api/v1/create_model", json={
            "session_id": session, "model_seq_id": 0, "base_model": TINY_MODEL_NAME, "lora_config": {"rank": RANK},
        })
        created.raise_for_status()
        model_id, request_id = created.json()["model_id"], created.json()["request_id"]
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while client.post("/api/v1/retrieve_future", json={"request_id": request_id}).json().get("type") == "try_again":
            if time.monotonic() > deadline:
                raise RuntimeError("create_model did not finish")
        ids = []
        for seq_id in range(2, count + 2):
            answer = client.post("/api/v1/optim_step", json={
                "model_id": model_id, "seq_id": seq_id, "adam_params": {"learning_rate": 1e-4}})
            answer.raise_for_status()
            ids.append(str(answer.json()["request_id"]))
    return ids


class LongPollers:
    """Holds one long-poll per request id open until `stop()`, from a child process (its asyncio client then
    shares no GIL with the heartbeat timer in this one)."""

    def __init__(self, server: Server, key: str, request_ids: list[str]) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process running torch and SDK threads
        self._in_flight = ctx.Value("i", 0)
        self._polls = ctx.Value("i", 0)
        self._stop = ctx.Event()
        self._errors: multiprocessing.Queue[str] = ctx.Queue()
        self._count = len(request_ids)
        self._process = ctx.Process(target=_hold_long_polls, daemon=True, args=(
            server.url, key, request_ids, self._in_flight, self._polls, self._stop, self._errors))

    @property
    def in_flight(self) -> int:
        return int(self._in_flight.value)

    @property
    def polls(self) -> int:
        return int(self._polls.value)

    def start(self, timeout_s: float = 120.0) -> None:
        self._process.start()
        deadline = time.monotonic() + timeout_s
        while self.in_flight < self._count and time.monotonic() < deadline and self._process.is_alive():
            time.sleep(0.05)
        time.sleep(1.0)  # let the server settle into holding them
        if self.in_flight < self._count:
            self.stop()
            raise RuntimeError(f"only {self.in_flight} of {self._count} long-polls opened")

    def stop(self) -> list[str]:
        """Close the long-polls; returns any unexpected answers they got."""
        self._stop.set()
        self._process.join(timeout=60)
        if self._process.is_alive():
            self._process.kill()
        errors = []
        while not self._errors.empty():
            errors.append(self._errors.get_nowait())
        return errors


def _hold_long_polls(url: str, key: str, request_ids: list[str], in_flight: Any, polls: Any, stop: Any,
                     errors: Any) -> None:
    """Child process: long-poll every id (re-polling on `try_again`, as the SDK does) until `stop` is set."""

    async def poll(client: httpx.AsyncClient, request_id: str) -> None:
        while True:
            with in_flight.get_lock():
                in_flight.value += 1
            try:
                answer = await client.post("/api/v1/retrieve_future", json={
                    "request_id": request_id, "allow_metadata_only": True})
            finally:
                with in_flight.get_lock():
                    in_flight.value -= 1
            with polls.get_lock():
                polls.value += 1
            if answer.status_code != 200 or answer.json().get("type") != "try_again":
                errors.put(f"{answer.status_code} {answer.text[:200]}")
                return

    async def main() -> None:
        limits = httpx.Limits(max_connections=len(request_ids) + 10, max_keepalive_connections=len(request_ids) + 10)
        async with httpx.AsyncClient(base_url=url, headers={"X-API-Key": key}, limits=limits,
                                     timeout=httpx.Timeout(45.0, connect=30.0)) as client:
            tasks = [asyncio.create_task(poll(client, rid)) for rid in request_ids]
            while not stop.is_set():
                await asyncio.sleep(0.1)
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(main())


# -- main ---------------------------------------------------------------------------------------------
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iterations", type=int, default=200, help="timed forward_backward calls per path")
    parser.add_argument("--heartbeats", type=int, default=300, help="timed heartbeats on the idle server")
    parser.add_argument("--heartbeat-seconds", type=float, default=35.0,
                        help="how long to time heartbeats with the long-polls open; longer than the server's "
                        "long-poll (25 s) so that the moment they all time out and re-poll is included")
    parser.add_argument("--long-polls", type=int, default=500, help="idle long-polls held open in phase (b)")
    parser.add_argument("--torch-threads", type=int, default=1, help="torch intra-op threads, both processes")
    parser.add_argument("--batch-window-ms", type=float, default=None,
                        help="the scheduler's batch window (CARPOOL_BATCH_WINDOW_MS); default: the server's own (5)")
    parser.add_argument("--fixed-batch-window", action="store_true",
                        help="wait the batch window for every request, also a lone tenant's "
                        "(CARPOOL_BATCH_WINDOW_ADAPTIVE=false); default: the server's own (adaptive)")
    args = parser.parse_args()
    torch.set_num_threads(args.torch_threads)
    threads = str(args.torch_threads)

    with tempfile.TemporaryDirectory(prefix="carpool-bench-gateway-") as tmp:
        model_dir = build_dev_model(Path(tmp) / "model", layers=2, hidden=64, vocab=512, seed=0)
        print(f"starting carpool serve on {TINY_MODEL_NAME} ...", flush=True)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        if args.batch_window_ms is not None:
            env["CARPOOL_BATCH_WINDOW_MS"] = str(args.batch_window_ms)
        if args.fixed_batch_window:
            env["CARPOOL_BATCH_WINDOW_ADAPTIVE"] = "false"
        server = start_server(Path(tmp) / "data", model_dir, extra_env=env)
        try:
            print("(a) forward_backward: SDK round trip vs. engine ...", flush=True)
            measured = measure_overhead(server, model_dir, args.iterations)
            overhead = measured[2]
            print("(b) session_heartbeat, idle server ...", flush=True)
            beater = server.create_tenant("bench-heartbeat")
            idle = heartbeats(server, beater, "session_heartbeat (no long-polls)", count=args.heartbeats)
            print(f"(b) queuing {args.long_polls} requests that never run and long-polling them ...", flush=True)
            idler = server.create_tenant("bench-idler")
            pollers = LongPollers(server, idler, queue_stuck_requests(server, idler, args.long_polls))
            pollers.start()
            try:
                loaded = heartbeats(server, beater, f"session_heartbeat ({args.long_polls} long-polls open)",
                                    seconds=args.heartbeat_seconds)
                held, polls = pollers.in_flight, pollers.polls
            finally:
                unexpected = pollers.stop()
            if unexpected:
                raise RuntimeError(f"a long-poll got an unexpected answer: {unexpected[0]}")
        finally:
            server.stop()

    print()
    print(f"{'latency (ms)':<44} {'n':>5} {'p50':>9} {'p95':>9} {'max':>9}")
    for series in (*measured, idle, loaded):
        print(series.row())
    print(f"long-polls held while the heartbeats ran: {held} (polls answered meanwhile: {polls}); "
          f"torch threads: {args.torch_threads}; batch window: "
          f"{'default' if args.batch_window_ms is None else f'{args.batch_window_ms:g} ms'}"
          f"{' (fixed)' if args.fixed_batch_window else ' (adaptive)'}; "
          f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(f"RESULT gateway_overhead_p50_ms={quantile(overhead.ms, 0.5):.2f} "
          f"gateway_overhead_p95_ms={quantile(overhead.ms, 0.95):.2f} "
          f"heartbeat_p50_ms={quantile(loaded.ms, 0.5):.2f} heartbeat_p95_ms={quantile(loaded.ms, 0.95):.2f}")


if __name__ == "__main__":
    main()
