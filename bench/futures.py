"""Futures at RL scale: 1,000 outstanding sampling futures of one tenant, resolved by the SDK's batched poller
(`retrieve_futures`, one long-poll per sampling client) vs. one-by-one polling (`retrieve_future` per future).

Starts `carpool serve` (a subprocess on 127.0.0.1, `tests/e2e/server.py`) on the tiny random-weight Qwen3 the
e2e suites use. Both modes run the unmodified SDK: `SamplingClient.sample(...)` N times at once, then wait for
every result. The server advertises `sample_use_retrieve_futures`; the one-by-one baseline is the same SDK with
that flag turned off in its copy of `client/config` (what every Tinker-compatible server without the batched
poller gets). Rounds alternate between the modes (batched first in odd rounds), each with a fresh sampling
session. Requests are counted by the server (`carpool_http_requests_total` of `retrieve_future` and
`retrieve_futures`, read from /metrics before and after a round); submissions (`asample`) are the same in both
modes and not in the ratio (the table shows them, and every route per future). Wall time runs from the first
submission to the last result. The server's open `retrieve_future` long-polls (`carpool_long_polls_in_flight`)
are sampled every 0.25 s: the batched poller's gain on a server is mostly there (one held poll per sampling
client instead of one per outstanding future). The mean sample batch is `carpool_runtime_sample_batches` over
the round's futures (how many queued samples the scheduler put in one decode).

The server runs torch single-threaded (`--torch-threads`, passed as OMP_NUM_THREADS / MKL_NUM_THREADS, as in
bench/gateway.py): on a shared 2-core machine two-thread OpenMP kernels stall whenever a core is taken (a
1-request sample batch of the tiny model took 0.55 s instead of 15 ms), and the stalls, not polling, decided
the wall time.

Note what the protocol leaves: in SDK 0.38 a completion reported by `retrieve_futures` is still fetched with one
`retrieve_future` (the payload; `api_future_impl.py` `_result_async` always enters its fetch loop after
`wait_for`), so the batched mode's floor is N fetches plus its few polls; the one-by-one mode pays N fetches
plus a re-poll for every long-poll hold (`CARPOOL_LONG_POLL_SECONDS`) a future waits. Both submit N `asample`s.

Prints a table; the last line is machine-readable:
RESULT batched_vs_single_wall=X requests_ratio=X

    .venv/bin/python bench/futures.py [--futures 1000] [--rounds 2] [--max-tokens 4] [--long-poll-seconds S]
        [--torch-threads 1]
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import tinker  # noqa: E402
from tinker import types  # noqa: E402

from tests.e2e.server import TINY_MODEL_NAME, Server, start_server  # noqa: E402

POLL_ROUTES = ("/api/v1/retrieve_future", "/api/v1/retrieve_futures")
SUBMIT_ROUTE = "/api/v1/asample"
COUNTED = (*POLL_ROUTES, SUBMIT_ROUTE)
SAMPLE_BATCHES = "carpool_runtime_sample_batches_total"
"""A `CounterMetricFamily` named `carpool_runtime_sample_batches` is exposed with the `_total` suffix."""
_COUNTER = re.compile(r'^carpool_http_requests_total\{(?P<labels>[^}]*)\} (?P<value>[0-9.e+]+)$')


@dataclass
class Round:
    mode: str
    wall_s: float
    requests: int
    """Poll requests: `retrieve_future` + `retrieve_futures`."""
    batched_polls: int
    submissions: int
    """`asample` requests (more than the futures only when the server answered 429)."""
    sample_batches: int
    peak_open_polls: int
    """Most `retrieve_future` long-polls held open at once (`carpool_long_polls_in_flight`, sampled)."""


class PeakSampler:
    """Samples the server's open-long-poll gauge in a thread while a round runs."""

    def __init__(self, server: Server, period_s: float = 0.25) -> None:
        self._server, self._period_s, self.peak = server, period_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> PeakSampler:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        with httpx.Client(timeout=10) as client:
            while not self._stop.wait(self._period_s):
                for line in client.get(f"{self._server.url}/metrics").text.splitlines():
                    if line.startswith("carpool_long_polls_in_flight"):
                        self.peak = max(self.peak, int(float(line.split()[-1])))


def server_counts(server: Server) -> dict[str, int]:
    """Requests per counted route and sample batches run so far, from the server's Prometheus series."""
    counts = dict.fromkeys((*COUNTED, SAMPLE_BATCHES), 0)
    for line in httpx.get(f"{server.url}/metrics", timeout=30).text.splitlines():
        if line.startswith(SAMPLE_BATCHES + "{"):
            counts[SAMPLE_BATCHES] += int(float(line.split()[-1]))
        match = _COUNTER.match(line)
        if match is None:
            continue
        for route in COUNTED:
            if f'route="{route}"' in match["labels"]:
                counts[route] += int(float(match["value"]))
    return counts


def make_client(server: Server, key: str, *, batched: bool) -> tinker.ServiceClient:
    service = tinker.ServiceClient(base_url=server.url, api_key=key)
    holder = service.holder
    config = holder.get_client_config()
    assert config.sample_use_retrieve_futures, "the server must advertise the batched poller"
    if not batched:  # the SDK as it runs against a server without retrieve_futures
        holder._client_config = config.model_copy(update={"sample_use_retrieve_futures": False})
    return service


def run_round(server: Server, service: tinker.ServiceClient, mode: str, n: int, max_tokens: int) -> Round:
    sampler = service.create_sampling_client(base_model=TINY_MODEL_NAME).result()
    prompt = types.ModelInput.from_ints([5, 17, 42, 99])
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    sampler.sample(prompt, 1, params).result()  # warm: the session exists, the poller (if any) is started
    before = server_counts(server)
    with PeakSampler(server) as open_polls:
        started = time.perf_counter()
        futures = [sampler.sample(prompt, 1, params) for _ in range(n)]
        for future in futures:
            assert len(future.result().sequences) == 1
        wall = time.perf_counter() - started
    after = server_counts(server)
    delta = {name: after[name] - before[name] for name in after}
    return Round(mode, wall, sum(delta[route] for route in POLL_ROUTES), delta["/api/v1/retrieve_futures"],
                 delta[SUBMIT_ROUTE], delta[SAMPLE_BATCHES], open_polls.peak)


def report(r: Round, n: int) -> str:
    """One round's line: wall, poll requests (and per future), submissions, mean sample batch, open polls."""
    return (f"wall {r.wall_s:7.2f} s  poll requests {r.requests:6d} ({r.requests / n:.3f}/future; "
            f"retrieve_futures {r.batched_polls}), asample {r.submissions}, "
            f"mean sample batch {n / max(1, r.sample_batches):5.1f}, peak open long-polls {r.peak_open_polls}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--futures", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=4)
    parser.add_argument("--long-poll-seconds", type=float, default=None,
                        help="the server's long-poll hold (default: its own, 25 s); a proxy with a short idle "
                             "timeout forces a short one, and then every waiting future re-polls that often")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="the server's torch threads (OMP_NUM_THREADS); 1 avoids OpenMP stalls on a busy box")
    args = parser.parse_args()
    logging.getLogger("tinker").setLevel(logging.ERROR)  # one-by-one polling warns on every try_again

    from worker.models.devmodel import build_dev_model

    with tempfile.TemporaryDirectory(prefix="carpool-bench-futures-") as tmp:
        model = build_dev_model(Path(tmp) / "model", layers=2, hidden=64, vocab=512, seed=0)
        threads = str(args.torch_threads)
        env = {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads}
        if args.long_poll_seconds is not None:
            env["CARPOOL_LONG_POLL_SECONDS"] = str(args.long_poll_seconds)
        server = start_server(Path(tmp) / "data", model, extra_env=env)
        try:
            key = server.create_tenant("rl")
            clients = {"batched": make_client(server, key, batched=True),
                       "single": make_client(server, key, batched=False)}
            rounds: list[Round] = []
            for i in range(args.rounds):
                order = ("batched", "single") if i % 2 == 0 else ("single", "batched")
                for mode in order:
                    rounds.append(run_round(server, clients[mode], mode, args.futures, args.max_tokens))
                    print(f"round {i + 1} {mode:8s} {report(rounds[-1], args.futures)}", flush=True)
            for client in clients.values():
                client.close("success").result()
        finally:
            server.stop()

    def median(mode: str, attr: str) -> float:
        return statistics.median(getattr(r, attr) for r in rounds if r.mode == mode)

    wall_ratio = median("single", "wall_s") / median("batched", "wall_s")
    requests_ratio = median("single", "requests") / max(1.0, median("batched", "requests"))
    hold = "server default" if args.long_poll_seconds is None else f"{args.long_poll_seconds:g} s"
    print(f"\n{args.futures} outstanding sampling futures of {args.max_tokens} tokens, long-poll hold {hold}, "
          f"torch threads {args.torch_threads}, medians of {args.rounds} rounds per mode:")
    for mode, label in (("batched", "batched poller"), ("single", "one-by-one")):
        requests = median(mode, "requests")
        print(f"  {label:15s}: {median(mode, 'wall_s'):7.2f} s, {requests:8.0f} poll requests "
              f"({requests / args.futures:.3f}/future), {median(mode, 'submissions'):6.0f} asample, "
              f"{median(mode, 'peak_open_polls'):6.0f} peak open long-polls")
    print(f"RESULT batched_vs_single_wall={wall_ratio:.2f} requests_ratio={requests_ratio:.2f}")


if __name__ == "__main__":
    main()
