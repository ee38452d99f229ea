"""Packing benchmark: packed multi-tenant passes vs. one adapter per pass vs. one adapter alone.

Two regimes, each run three ways in the same process (forward_backward + optim_step per step):
  packed        all tenants' sequences in one pass (Carpool)
  one_per_pass  one pass per tenant, one after another (how Twinkle and SkyRL run)
  single        one adapter holding all the same sequences (the ideal: no multi-tenancy at all)

    small  tiny Qwen3 (hidden 256, 4 layers), 8 adapters x 1 sequence x 32 tokens (RL regime)
    large  SmolLM2-135M, 8 adapters x 2 sequences x 256 tokens (compute-bound regime)

The three ways are interleaved round by round (order alternating) so drift on a shared machine hits them
equally; times are medians over rounds, ratios medians of the per-round (paired) ratios.
The last line is machine-readable:
RESULT small_packed_vs_one_per_pass=X large_packed_vs_one_per_pass=X small_packed_vs_single=X
large_packed_vs_single=X
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec  # noqa: E402
from worker.engine.engine import Engine, EngineConfig  # noqa: E402

HP = AdamParams(learning_rate=1e-4)
# Peak dense bf16 FLOP/s for MFU on known accelerators (tensor cores, no sparsity).
PEAK_FLOPS = {"H200": 989e12, "H100": 989e12, "A100": 312e12}


@dataclass
class Regime:
    name: str
    model_dir: Path
    adapters: int
    seqs_per_adapter: int
    seq_len: int
    rounds: int


@dataclass
class Measured:
    seconds: float
    tokens: int
    rounds: list[float]
    """Seconds per step in each round, in round order (for paired ratios)."""

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds


def _datum(rng: np.random.Generator, vocab: int, n: int) -> Datum:
    seq = rng.integers(0, vocab, n + 1)
    return Datum(seq[:-1].astype(np.int64), {"target_tokens": seq[1:].astype(np.int64),
                                             "weights": np.ones(n, np.float32)})


def _runs(engine: Engine, regime: Regime, data: list[list[Datum]]) -> dict[str, Callable[[], None]]:
    ids = [AdapterId(f"tenant-{i}") for i in range(regime.adapters)]
    single = AdapterId("single")

    def packed() -> None:
        engine.forward_backward([ForwardBackwardWork(aid, data[i]) for i, aid in enumerate(ids)])
        for aid in ids:
            engine.optim_step(aid, HP)

    def one_per_pass() -> None:
        for i, aid in enumerate(ids):
            engine.forward_backward([ForwardBackwardWork(aid, data[i])])
            engine.optim_step(aid, HP)

    def single_adapter() -> None:
        engine.forward_backward([ForwardBackwardWork(single, [d for ds in data for d in ds])])
        engine.optim_step(single, HP)

    return {"packed": packed, "one_per_pass": one_per_pass, "single": single_adapter}


def run_regime(regime: Regime, config: EngineConfig, rank: int) -> dict[str, Measured]:
    engine = Engine(regime.model_dir, name=regime.name, config=config)
    rss_before = _rss_bytes()
    for i in range(regime.adapters):
        engine.create_adapter(AdapterId(f"tenant-{i}"), LoraSpec(rank=rank, seed=i))
    engine.create_adapter(AdapterId("single"), LoraSpec(rank=rank, seed=99))
    rss_per_adapter = (_rss_bytes() - rss_before) / (regime.adapters + 1)
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    data = [[_datum(rng, vocab, regime.seq_len) for _ in range(regime.seqs_per_adapter)]
            for _ in range(regime.adapters)]
    tokens = regime.adapters * regime.seqs_per_adapter * regime.seq_len
    runs = _runs(engine, regime, data)
    for fn in runs.values():  # warm-up: allocator, optimizer state, kernel selection
        fn()
    _sync(engine)
    per_adapter = engine.adapter(AdapterId("tenant-0")).num_bytes()
    times: dict[str, list[float]] = {k: [] for k in runs}
    for r in range(regime.rounds):
        order = list(runs) if r % 2 == 0 else list(reversed(runs))
        for name in order:
            started = time.perf_counter()
            runs[name]()
            _sync(engine)
            times[name].append(time.perf_counter() - started)
    _print_regime(regime, engine, per_adapter, rss_per_adapter)
    print(f"[{regime.name}] process RSS after the runs: {_rss_bytes() / 2**20:.0f} MiB (model, adapters, and the "
          f"activation memory a CPU engine keeps for reuse between passes)")
    return {k: Measured(statistics.median(v), tokens, v) for k, v in times.items()}


def paired_ratio(faster: Measured, slower: Measured) -> float:
    """Throughput ratio faster ÷ slower as the median of per-round ratios: the two ran back to back in
    each round, so slow drift on a shared machine cancels within a pair instead of between medians."""
    return statistics.median(s / f for f, s in zip(faster.rounds, slower.rounds, strict=True))


def _print_regime(regime: Regime, engine: Engine, per_adapter: int, rss_per_adapter: float) -> None:
    n_params = sum(p.numel() for p in engine.lm.model.parameters())
    print(f"[{regime.name}] model={regime.model_dir.name} params={n_params / 1e6:.1f}M "
          f"device={engine.lm.device} dtype={engine.lm.dtype} adapters={regime.adapters} "
          f"x {regime.seqs_per_adapter} seq x {regime.seq_len} tok, passes of <= {engine.micro_batch_tokens} tokens")
    print(f"[{regime.name}] memory per extra resident adapter: {per_adapter / 2**20:.2f} MiB "
          f"(its bank row: LoRA factors, gradient and AdamW moments); creating the adapters grew "
          f"process RSS by {rss_per_adapter / 2**20:.2f} MiB each")


def _report(regime: Regime, measured: dict[str, Measured], n_params: int, device: str) -> None:
    for name, m in measured.items():
        line = f"[{regime.name}] {name:>13}: {m.seconds * 1000:9.1f} ms/step  {m.tokens_per_s:10.0f} tokens/s"
        mfu = _mfu(m, n_params, device)
        print(line + (f"  MFU {mfu:.1%}" if mfu is not None else ""))


def _mfu(m: Measured, n_params: int, device: str) -> float | None:
    if device != "cuda":
        return None
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return None if peak is None else 4 * n_params * m.tokens_per_s / peak


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _sync(engine: Engine) -> None:
    """A step's whole work done: optimizer updates the engine left pending, and the GPU's queue."""
    engine.apply_pending_steps()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _small_model(workdir: Path, hidden: int, layers: int) -> Path:
    from worker.models.devmodel import build_dev_model

    return build_dev_model(workdir / f"qwen3-h{hidden}-l{layers}", layers=layers, hidden=hidden, vocab=2048, seed=0)


def _large_model(source: str) -> Path:
    from worker.models.sources import default_cache_dir, resolve_model_source

    return resolve_model_source(source, default_cache_dir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--regimes", default="small,large")
    parser.add_argument("--rounds-small", type=int, default=40)
    parser.add_argument("--rounds-large", type=int, default=4)
    parser.add_argument("--large-model", default="smollm2-135m", help="any base-model source")
    parser.add_argument("--small-hidden", type=int, default=256)
    parser.add_argument("--small-layers", type=int, default=4)
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--large-seq-len", type=int, default=256)
    parser.add_argument("--device", default=None)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--lora-strategy", default="auto")
    parser.add_argument("--micro-batch-tokens", type=int, default=None,
                        help="tokens per packed pass (EngineConfig.micro_batch_tokens); default: the engine's "
                             "choice for the device (512 on CPU, one pass per call on a GPU)")
    args = parser.parse_args()
    config = EngineConfig(device=args.device, dtype=args.dtype, lora_strategy=args.lora_strategy,
                          max_tokens_per_pass=1 << 16, micro_batch_tokens=args.micro_batch_tokens)
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, cpus {os.cpu_count()}, "
          f"cuda {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
    ratios: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        regimes = {
            "small": lambda: Regime("small", _small_model(Path(tmp), args.small_hidden, args.small_layers),
                                    args.adapters, 1, 32, args.rounds_small),
            "large": lambda: Regime("large", _large_model(args.large_model), args.adapters, 2,
                                    args.large_seq_len, args.rounds_large),
        }
        for name in args.regimes.split(","):
            regime = regimes[name]()
            measured = run_regime(regime, config, args.rank)
            device = "cuda" if torch.cuda.is_available() and args.device != "cpu" else "cpu"
            n_params = _param_count(regime.model_dir)
            _report(regime, measured, n_params, device)
            ratios[f"{name}_packed_vs_one_per_pass"] = paired_ratio(measured["packed"], measured["one_per_pass"])
            ratios[f"{name}_packed_vs_single"] = paired_ratio(measured["packed"], measured["single"])
            # The room packing has on this machine: one adapter batching everything vs one pass per tenant.
            # packed / one_per_pass can reach it only if multi-tenancy cost nothing (packed / single = 1).
            room = paired_ratio(measured["single"], measured["one_per_pass"])
            print(f"[{name}] room: single / one_per_pass = {room:.2f} (the ceiling of packed / one_per_pass)")
    keys = [f"{r}_{k}" for k in ("packed_vs_one_per_pass",) for r in ("small", "large")]
    keys += [f"{r}_packed_vs_single" for r in ("small", "large")]
    print("RESULT " + " ".join(f"{k}={ratios[k]:.2f}" for k in keys if k in ratios))


def _param_count(model_dir: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model_dir.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            for key in st.keys():  # noqa: SIM118 - safe_open has no __iter__
                total += int(np.prod(st.get_slice(key).get_shape()))
    return total


if __name__ == "__main__":
    main()
