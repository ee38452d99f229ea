"""Server CPU per request, by kind: what one HTTP request costs the service beyond the engine's passes.

`bench/service.py` found that eight small tenants cost more server CPU per token than one tenant sending the
same tokens because each tenant step is four HTTP requests (`forward_backward`, `optim_step` and their two
`retrieve_future`s) with their bookkeeping, which the single tenant pays once per 8 x 32 tokens. This script
measures that per-request cost directly, one kind at a time, so a change to the request path can be judged
by CPU time rather than by wall-clock ratios on a shared machine.

It starts `carpool serve` (embedded, subprocess, the e2e dev model: 2 layers, hidden 64, vocab 512), makes
one tenant and one model through the real SDK, then sends each kind `--calls` times in sequence over one
keep-alive connection (plain httpx, the SDK's wire format) and reads the server's CPU per thread from
`/proc` (utime + stime; thread names from `py-spy dump` when py-spy is installed). Kinds:

    healthz      GET /api/v1/healthz: the HTTP floor (uvicorn, httptools, middleware, routing), no auth
    heartbeat    POST session_heartbeat: + API-key auth and one database transaction
    get_info     POST get_info: + a model lookup
    optim_pair   POST optim_step + POST retrieve_future (long-poll): a submission, a barrier on the
                 scheduler loop and its completion bookkeeping, the result's wake-up and rendering
    sdk_step     SDK forward_backward(1 x 32 tokens).result() + optim_step().result(): one tenant step
    sample       SDK SamplingClient.sample(4 samples x 16 tokens).result(): a submission, the batched poller's
                 held `retrieve_futures` and its two ack polls, the payload's `retrieve_future`, and the pass

CPU times are counted in clock ticks (10 ms), so each figure is a mean over many calls; they depend far less
on other load than wall-clock figures do (shown too). Last line:
RESULT healthz_cpu_ms=X heartbeat_cpu_ms=X get_info_cpu_ms=X optim_pair_cpu_ms=X sdk_step_cpu_ms=X
sample_cpu_ms=X

    .venv/bin/python bench/request_cost.py [--calls 1000] [--kinds sdk_step] [--profile /tmp/spy]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import httpx  # noqa: E402
import tinker  # noqa: E402
from service import datum, thread_cpu_seconds, thread_names  # noqa: E402
from tinker import types  # noqa: E402

from tests.e2e.server import TINY_MODEL_NAME, start_server  # noqa: E402

HP = {"learning_rate": 1e-4}
SERVER_ENV = {"OMP_NUM_THREADS": "1", "CARPOOL_EDGE_RATE_PER_SECOND": "1000000000"}
"""One torch thread; the per-key rate limit raised out of reach (its default, 500 requests per second, answers
429 to back-to-back calls over one connection) while the limiter still runs, as it does for every request."""
SLOW_KINDS = ("sdk_step", "sample")
"""Kinds that run a pass per call: measured over a fifth of `--calls` (at least 50)."""
VOCAB = 512
SAMPLE_COUNT = 4
SAMPLE_PROMPT = types.ModelInput.from_ints([3, 17, 29, 41, 53, 65, 77, 89])
SAMPLE_PARAMS = types.SamplingParams(max_tokens=16, temperature=1.0)


class Probe:
    """One tenant's model and the raw calls of each kind."""

    def __init__(self, url: str, api_key: str) -> None:
        self.service = tinker.ServiceClient(base_url=url, api_key=api_key)
        self.training = self.service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4).result()
        self.model_id = self.training.model_id
        # Raw calls take this model's seq ids; the SDK's steps run on a model of their own.
        self.sdk_training = self.service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4).result()
        self.session_id = self.model_id.split(":train:")[0]
        self.http = httpx.Client(base_url=url, headers={"X-API-Key": api_key}, timeout=60)
        self.seq = self._next_free_seq()
        self.data = [datum(0, 32, VOCAB)]
        self.sampler: tinker.SamplingClient | None = None

    def _next_free_seq(self) -> int:
        """The first seq id the SDK has not used on this model."""
        for seq in range(1, 64):
            answer = self.http.post("/api/v1/optim_step", json=self._optim_body(seq))
            if answer.status_code == 200:
                self._retrieve(answer.json()["request_id"])
                return seq + 1
        raise RuntimeError("no free seq id found")

    def _optim_body(self, seq: int) -> dict[str, object]:
        return {"model_id": self.model_id, "seq_id": seq, "type": "optim_step", "adam_params": HP}

    def _retrieve(self, request_id: str) -> dict[str, object]:
        answer = self.http.post("/api/v1/retrieve_future", json={"request_id": request_id,
                                                                  "allow_metadata_only": True})
        answer.raise_for_status()
        return answer.json()

    def healthz(self) -> None:
        self.http.get("/api/v1/healthz").raise_for_status()

    def heartbeat(self) -> None:
        self.http.post("/api/v1/session_heartbeat", json={"session_id": self.session_id,
                                                          "type": "session_heartbeat"}).raise_for_status()

    def get_info(self) -> None:
        self.http.post("/api/v1/get_info", json={"model_id": self.model_id, "type": "get_info"}).raise_for_status()

    def optim_pair(self) -> None:
        answer = self.http.post("/api/v1/optim_step", json=self._optim_body(self.seq))
        answer.raise_for_status()
        self.seq += 1
        if "metrics" not in self._retrieve(answer.json()["request_id"]):
            raise RuntimeError("optim_step did not complete")

    def sample(self) -> None:
        """Through the SDK's sampling client of the SDK model's weights (made on first use)."""
        if self.sampler is None:
            self.sampler = self.sdk_training.save_weights_and_get_sampling_client().result()
        out = self.sampler.sample(SAMPLE_PROMPT, SAMPLE_COUNT, SAMPLE_PARAMS).result()
        if len(out.sequences) != SAMPLE_COUNT:
            raise RuntimeError(f"sample answered {len(out.sequences)} sequences")

    def sdk_step(self) -> None:
        """Through the SDK, on its own model (the SDK numbers its requests itself)."""
        self.sdk_training.forward_backward(self.data, "cross_entropy").result()
        self.sdk_training.optim_step(types.AdamParams(**HP)).result()


def measure(pid: int, names: dict[int, str], call: Callable[[], None], calls: int,
            profile: Path | None = None) -> tuple[float, float, str]:
    """Mean server CPU ms per call, mean wall ms per call, and the CPU split by thread (py-spied into
    `profile`, raw folded stacks per thread, when given)."""
    for _ in range(max(10, calls // 20)):  # warm-up
        call()
    names = {**names, **thread_names(pid)}  # threads started since (the blocking pool grows on demand)
    spy = None if profile is None else subprocess.Popen(
        [str(Path(sys.executable).with_name("py-spy")), "record", "--pid", str(pid), "--format", "raw", "--output",
         str(profile), "--rate", "500", "--threads", "--nonblocking", "--duration", "600"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if spy is not None:
        time.sleep(1.5)  # attached
    before, started = thread_cpu_seconds(pid), time.perf_counter()
    for _ in range(calls):
        call()
    after, wall = thread_cpu_seconds(pid), time.perf_counter() - started
    if spy is not None:
        spy.send_signal(2)  # py-spy writes its output on SIGINT
        spy.wait(timeout=60)
    by_name: dict[str, float] = {}
    for tid, cpu in after.items():
        name = names.get(tid, "other")
        by_name[name] = by_name.get(name, 0.0) + cpu - before.get(tid, 0.0)
    total = sum(by_name.values())
    split = "  ".join(f"{n} {1000 * c / calls:.3f}" for n, c in sorted(by_name.items(), key=lambda kv: -kv[1])
                      if c > 0)
    return 1000 * total / calls, 1000 * wall / calls, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=1000, help="calls per kind")
    parser.add_argument("--kinds", default="healthz,heartbeat,get_info,optim_pair,sdk_step,sample")
    parser.add_argument("--profile", type=Path, default=None,
                        help="py-spy the server into FILE-<kind>.txt while each kind is measured")
    args = parser.parse_args()
    from worker.models.devmodel import build_dev_model

    with tempfile.TemporaryDirectory(prefix="carpool-bench-request-cost-") as tmp:
        model_dir = build_dev_model(Path(tmp) / "model", layers=2, hidden=64, vocab=VOCAB, seed=0)
        server = start_server(Path(tmp) / "data", model_dir, extra_env=SERVER_ENV, mode="embedded")
        try:
            probe = Probe(server.url, server.create_tenant("request-cost"))
            pid = server.process.pid
            names = thread_names(pid)
            kinds = {"healthz": probe.healthz, "heartbeat": probe.heartbeat, "get_info": probe.get_info,
                     "optim_pair": probe.optim_pair, "sdk_step": probe.sdk_step, "sample": probe.sample}
            results: dict[str, float] = {}
            print(f"{'kind':<11} {'cpu ms':>7} {'wall ms':>8}  server CPU ms per call by thread")
            for kind in args.kinds.split(","):
                calls = args.calls if kind not in SLOW_KINDS else max(50, args.calls // 5)
                profile = None if args.profile is None else Path(f"{args.profile}-{kind}.txt")
                cpu, wall, split = measure(pid, names, kinds[kind], calls, profile)
                results[kind] = cpu
                print(f"{kind:<11} {cpu:>7.3f} {wall:>8.2f}  {split}", flush=True)
        finally:
            server.stop()
    print("RESULT " + " ".join(f"{kind}_cpu_ms={cpu:.3f}" for kind, cpu in results.items()))


if __name__ == "__main__":
    main()
