"""Checkpoint storage benchmark: save and load of a SmolLM2-135M rank-32 adapter with optimizer state.

Three ways, in one run, through the code the service uses (`Engine.save_adapter` / `load_adapter`, behind
`StagedBackend` for S3):

    local   the adapter written to / read from a local directory (the default store)
    s3      staged, uploaded to S3 with a manifest (sha256 of every file) and, on load, downloaded into an
            empty cache and verified before the engine reads it (another node's first load)
    cached  a load from S3 whose checkpoint is already in this node's cache (one manifest GET)

For context, not in the RESULT line, each round also times a local save into a scratch directory (no
fsync: what the local save would cost if it were not durable, so the effect of fsync on the baseline is
visible) and the bare transfers of the same files with boto3 (PutObject / GetObject from and to memory,
files in parallel: the least any S3 save or cold load can cost against this server). They print as
INFO ratios to the local save / load.

The S3 server is `moto_server` on 127.0.0.1 by default (started here), or real S3/MinIO with
`--endpoint-url` / `--bucket` (credentials from the standard AWS chain). Rounds are interleaved so drift on
a shared machine hits all three alike; the first round is a warm-up. The last line is machine-readable:
RESULT s3_save_vs_local=X s3_load_vs_local=X cached_load_vs_local=X (medians of the per-round ratios).
Aims: <= 2.0, <= 2.0, <= 1.1.

    .venv/bin/python bench/storage.py                       # moto on this box
    .venv/bin/python bench/storage.py --endpoint-url http://minio:9000 --bucket carpool-bench
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec  # noqa: E402
from services.storage.durability import mark_scratch  # noqa: E402
from services.storage.s3 import S3CheckpointStore, build_s3_store  # noqa: E402
from services.storage.s3_transfer import client_config  # noqa: E402
from services.storage.staging import StagedBackend  # noqa: E402


@contextmanager
def moto_server() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
                       "AWS_DEFAULT_REGION": "us-east-1"}.items():
        os.environ.setdefault(key, value)
    binary = Path(sys.executable).with_name("moto_server")
    process = subprocess.Popen([str(binary), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"http://127.0.0.1:{port}"
    finally:
        process.terminate()
        process.wait(timeout=10)


def trained_engine(source: str, rank: int) -> tuple[object, AdapterId]:
    """The base model with one rank-`rank` adapter after a step (so it has Adam moments)."""
    import numpy as np

    from worker.engine.engine import Engine, EngineConfig
    from worker.models.sources import default_cache_dir, resolve_model_source

    engine = Engine(resolve_model_source(source, default_cache_dir()), name="bench",
                    config=EngineConfig(device="cpu", dtype="float32"))
    adapter = AdapterId("bench-adapter")
    engine.create_adapter(adapter, LoraSpec(rank=rank, seed=0, train_attn=True, train_mlp=True))
    tokens = np.random.default_rng(0).integers(1, 1000, 33)
    datum = Datum(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(32, np.float32)})
    engine.forward_backward([ForwardBackwardWork(adapter, [datum])])
    engine.optim_step(adapter, AdamParams(learning_rate=1e-3))
    return engine, adapter


def timed(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def bare_transfers(client: Any, bucket: str, local: Path, i: int) -> dict[str, float]:
    """PutObject of each checkpoint file's bytes from memory, then GetObject into memory (files in parallel)."""
    blobs = {f.name: f.read_bytes() for f in local.iterdir() if f.is_file()}

    def each(fn: Callable[[str], object]) -> Callable[[], object]:
        def run_all() -> object:
            with ThreadPoolExecutor(len(blobs)) as pool:
                return list(pool.map(fn, blobs))
        return run_all

    put = each(lambda name: client.put_object(Bucket=bucket, Key=f"bare/r{i}/{name}", Body=blobs[name]))
    get = each(lambda name: client.get_object(Bucket=bucket, Key=f"bare/r{i}/{name}")["Body"].read())
    return {"bare_put": timed(put), "bare_get": timed(get)}


def one_round(engine: Any, adapter: AdapterId, staged: StagedBackend, cold: StagedBackend,
              writer: S3CheckpointStore, bare: Any, local: Path, i: int) -> dict[str, float]:
    """Each operation once: local save/load, S3 save, S3 load into an empty cache, S3 load from the cache;
    then the context figures (an unsynced local save, bare transfers of the same files)."""
    remote = writer.local_path(writer.uri_for("bench-tenant", "bench-run", "training", f"r{i}"))
    scratch = local.with_name(f"{local.name}-scratch")
    scratch.mkdir()
    mark_scratch(scratch)
    out = {
        "local_save": timed(lambda: engine.save_adapter(adapter, local, with_optimizer=True)),
        "s3_save": timed(lambda: staged.save_adapter(adapter, remote, with_optimizer=True)),
        "local_load": timed(lambda: engine.load_adapter(AdapterId("l"), local, with_optimizer=True)),
        "s3_load": timed(lambda: cold.load_adapter(AdapterId("s"), remote, with_optimizer=True)),
        "cached": timed(lambda: cold.load_adapter(AdapterId("c"), remote, with_optimizer=True)),
        "unsynced_save": timed(lambda: engine.save_adapter(adapter, scratch / "c", with_optimizer=True)),
    }
    out.update(bare_transfers(bare, writer.location.bucket, local, i))
    for name in ("l", "s", "c"):
        engine.drop_adapter(AdapterId(name))
    shutil.rmtree(local)
    shutil.rmtree(scratch)
    return out


def run(args: argparse.Namespace, endpoint: str | None, work: Path) -> dict[str, list[float]]:
    import boto3

    engine, adapter = trained_engine(args.source, args.rank)
    bucket = args.bucket or f"carpool-bench-{uuid.uuid4().hex[:8]}"
    bare = boto3.session.Session().client("s3", endpoint_url=endpoint, config=client_config(30.0, 3))
    if args.bucket is None:
        bare.create_bucket(Bucket=bucket)

    def store(cache: str) -> S3CheckpointStore:
        return build_s3_store(f"s3://{bucket}/bench", cache_dir=work / cache, cache_max_bytes=1 << 34,
                              endpoint_url=endpoint)

    writer = store("writer-cache")
    staged = StagedBackend(engine, writer)  # type: ignore[arg-type]
    times: dict[str, list[float]] = {}
    for i in range(args.rounds):
        cold = StagedBackend(engine, store(f"cold-{i}"))  # type: ignore[arg-type]
        for key, seconds in one_round(engine, adapter, staged, cold, writer, bare, work / f"local-{i}", i).items():
            times.setdefault(key, []).append(seconds)
    size = writer.size(writer.uri_for("bench-tenant", "bench-run", "training", "r0"))
    print(f"checkpoint: {size / 1e6:.1f} MB (rank {args.rank}, weights + Adam moments), {args.rounds} rounds")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--source", default="smollm2-135m", help="Base model source (default: SmolLM2-135M)")
    parser.add_argument("--rank", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=8, help="Rounds, the first one a warm-up")
    parser.add_argument("--endpoint-url", default=None, help="S3-compatible endpoint; default: a local moto")
    parser.add_argument("--bucket", default=None, help="Existing bucket (with --endpoint-url); default: a new one")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="carpool-bench-storage-") as tmp:
        if args.endpoint_url:
            times = run(args, args.endpoint_url, Path(tmp))
        else:
            with moto_server() as endpoint:
                times = run(args, endpoint, Path(tmp))
    times = {k: v[1:] for k, v in times.items()}  # the first round warms imports, page cache and connections
    for key, values in times.items():
        print(f"{key:>10}: median {statistics.median(values) * 1000:8.1f} ms  "
              f"(all: {', '.join(f'{t * 1000:.0f}' for t in values)})")

    def ratio(num: str, den: str) -> float:
        # Per-round ratios: the operations of one round ran back to back, under the same machine load.
        return statistics.median(a / b for a, b in zip(times[num], times[den], strict=True))

    print(f"INFO unsynced_local_save_vs_local={ratio('unsynced_save', 'local_save'):.2f} "
          f"s3_save_vs_unsynced_local={ratio('s3_save', 'unsynced_save'):.2f} "
          f"bare_put_vs_local_save={ratio('bare_put', 'local_save'):.2f} "
          f"bare_get_vs_local_load={ratio('bare_get', 'local_load'):.2f} "
          f"s3_save_vs_bare_put={ratio('s3_save', 'bare_put'):.2f} "
          f"s3_load_vs_bare_get={ratio('s3_load', 'bare_get'):.2f}")
    print(f"RESULT s3_save_vs_local={ratio('s3_save', 'local_save'):.2f} "
          f"s3_load_vs_local={ratio('s3_load', 'local_load'):.2f} "
          f"cached_load_vs_local={ratio('cached', 'local_load'):.2f}")


if __name__ == "__main__":
    main()
