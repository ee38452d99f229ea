"""Sampling packing benchmark: many adapters' samples in one batch vs. the same samples from one adapter.

The engine alone, in-process (no server): `Engine.sample` on the tiny random-weight Qwen3 (hidden 256, 4
layers, vocab 4096), LoRA rank `--rank`, `--threads` torch threads, three batches of the same shape:

    multi     `--adapters` requests of `--samples` samples each, every request its own adapter
    same      the same requests, all from one adapter (what many requests cost, without many adapters)
    single    one request of adapters x samples samples from one adapter (no multi-tenancy at all)

Each prompt is 8 tokens and each sample `--tokens` long. The three batches run in a random order every round,
and each is measured as the CPU time of this thread per generated token. Medians are taken over the rounds,
the first round (warm-up) left out. The last line is machine-readable (single ÷ multi and single ÷ same: 1 =
packing costs nothing):
RESULT sample_single_vs_multi=X sample_single_vs_same=X

    .venv/bin/python bench/sample_packing.py [--rounds 25] [--adapters 8] [--samples 4] [--tokens 32]
"""

from __future__ import annotations

import argparse
import os
import random
import resource
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from services.domain.sampling import SampleWork, SamplingParams  # noqa: E402
from services.domain.training import AdapterId, LoraSpec  # noqa: E402
from worker.engine.engine import Engine, EngineConfig  # noqa: E402
from worker.models.devmodel import build_dev_model  # noqa: E402

PROMPT = np.array([3, 17, 29, 41, 53, 65, 77, 89], dtype=np.int64)


def thread_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_THREAD)
    return usage.ru_utime + usage.ru_stime


def batches(args: argparse.Namespace) -> dict[str, Callable[[], list[SampleWork]]]:
    params = SamplingParams(max_tokens=args.tokens, temperature=1.0)
    ids = [AdapterId(f"tenant-{i}") for i in range(args.adapters)]
    return {
        "multi": lambda: [SampleWork(aid, PROMPT, args.samples, params) for aid in ids],
        "same": lambda: [SampleWork(ids[0], PROMPT, args.samples, params) for _ in ids],
        "single": lambda: [SampleWork(ids[0], PROMPT, args.samples * args.adapters, params)],
    }


def measure(engine: Engine, works: list[SampleWork]) -> float:
    """CPU ms of this thread per generated token for one `Engine.sample` call."""
    started = thread_cpu_s()
    results = engine.sample(works)
    spent = thread_cpu_s() - started
    tokens = sum(len(seq.tokens) for result in results for seq in getattr(result, "sequences", []))
    if tokens == 0:
        raise SystemExit(f"no tokens generated: {results!r}")
    return 1000 * spent / tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="samples per request in `multi` and `same`")
    parser.add_argument("--tokens", type=int, default=32, help="tokens per sample")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the service bench's default)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_dev_model(Path(tmp) / "tiny", layers=4, hidden=256, vocab=4096)
        engine = Engine(model_dir, name="tiny", config=EngineConfig(device="cpu", dtype="float32"))
        for i in range(args.adapters):
            engine.create_adapter(AdapterId(f"tenant-{i}"), LoraSpec(rank=args.rank, seed=i))
        made = batches(args)
        per_token: dict[str, list[float]] = {name: [] for name in made}
        for round_index in range(args.rounds + 1):
            for name in random.sample(list(made), len(made)):
                cpu_ms = measure(engine, made[name]())
                if round_index > 0:  # round 0 warms every path
                    per_token[name].append(cpu_ms)
    medians = {name: statistics.median(values) for name, values in per_token.items()}
    for name, value in medians.items():
        print(f"{name:>7}: {value:.3f} CPU ms per generated token (median of {args.rounds} rounds)")
    print(f"RESULT sample_single_vs_multi={medians['single'] / medians['multi']:.3f} "
          f"sample_single_vs_same={medians['single'] / medians['same']:.3f}")


if __name__ == "__main__":
    main()
