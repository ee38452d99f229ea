"""Cluster mode on S3 storage (moto), two worker replicas with separate local directories.

1. A tenant trains and saves on replica A; A is killed and its disk wiped; the tenant loads the checkpoint
   (weights + Adam moments) on replica B — which can only get it from the bucket — and continues with the
   losses of an uninterrupted run.
2. A process killed in the middle of an upload leaves objects but no manifest: nothing partial is ever
   listed or loaded, the sweep removes the debris, and a later save of the same checkpoint works.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from deploy.cluster_wiring import cluster_config
from services.db.testing import scratch_postgres_database
from services.storage import StorageError
from tests.integration.cluster_support import (
    BASE,
    LEARNING_RATE,
    RANK,
    REDIS_URL,
    ClusterStack,
    cluster_settings,
    create_tenant_keys,
    domain_datum,
    prepared_database,
    scratch_prefix,
    seed_of,
    tenant_batches,
)
from tests.required import require_postgres
from tests.s3_support import S3Server, make_store, s3_client

STEPS = 4


@pytest.fixture
def stack(tmp_path: Path, tiny_model_dir: Path, s3_server: S3Server, s3_bucket: str) -> Iterator[ClusterStack]:
    require_postgres()
    with scratch_postgres_database() as url, scratch_prefix() as prefix:
        settings = cluster_settings(tmp_path / "gateway", tiny_model_dir, prepared_database(url), REDIS_URL, prefix,
                                    storage_url=f"s3://{s3_bucket}/ckpt", s3_endpoint_url=s3_server.url)
        stack = ClusterStack(settings)
        try:
            yield stack
        finally:
            stack.close()


def _replica(stack: ClusterStack, local_dir: Path) -> object:
    """A thread-hosted replica whose data and S3 cache live only in `local_dir` (as on its own machine)."""
    from worker.serve.replica import ReplicaHost

    config = cluster_config(stack.settings)
    assert config.storage is not None
    config = replace(config, data_dir=str(local_dir),
                     storage=replace(config.storage, cache_dir=str(local_dir / "s3-cache")))
    host = ReplicaHost(config.spec(BASE), config)
    stack.replicas.append(host)
    return host


def _reference_losses(model_dir: Path) -> list[float]:
    from services.domain.training import AdamParams, AdapterId, ForwardBackwardWork, LoraSpec
    from worker.engine.engine import Engine, EngineConfig

    engine = Engine(model_dir, name=BASE, config=EngineConfig(device="cpu", dtype="float32"))
    adapter = AdapterId("reference")
    engine.create_adapter(adapter, LoraSpec(rank=RANK, seed=seed_of(0)))
    losses = []
    for batch in tenant_batches(0, STEPS):
        result = engine.forward_backward([ForwardBackwardWork(adapter, [domain_datum(t) for t in batch])])[0]
        losses.append(result.metrics["loss:sum"])  # type: ignore[union-attr]
        engine.optim_step(adapter, AdamParams(learning_rate=LEARNING_RATE))
    return losses


def _steps(training: object, batches: list[object]) -> list[float]:
    from tinker import types

    losses = []
    for batch in batches:
        data = [types.Datum(model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                            loss_fn_inputs={"target_tokens": t[1:].tolist(), "weights": [1.0] * (len(t) - 1)})
                for t in batch]  # type: ignore[attr-defined]
        fb = training.forward_backward(data, "cross_entropy")  # type: ignore[attr-defined]
        training.optim_step(types.AdamParams(learning_rate=LEARNING_RATE)).result()  # type: ignore[attr-defined]
        losses.append(fb.result().metrics["loss:sum"])
    return losses


def test_save_on_one_replica_load_and_continue_on_the_other(stack: ClusterStack, tiny_model_dir: Path,
                                                            tmp_path: Path, s3_server: S3Server) -> None:
    import pyrage
    import tinker

    first = _replica(stack, tmp_path / "node-a")
    stack.start_scheduler()
    stack.start_gateway()
    key = create_tenant_keys(stack.settings.resolved_database_url(), 1)[0]
    service = tinker.ServiceClient(base_url=stack.url, api_key=key)
    batches = tenant_batches(0, STEPS)
    training = service.create_lora_training_client(base_model=BASE, rank=RANK, seed=seed_of(0)).result()
    losses = _steps(training, batches[:2])
    path = training.save_state("half").result().path
    assert list((tmp_path / "node-a" / "s3-cache").rglob("carpool_state.safetensors"))  # staged through A
    # An age-encrypted export is encrypted on the replica before its upload: only ciphertext in the bucket.
    recipient = str(pyrage.x25519.Identity.generate().to_public())
    training.save_weights_external("enc", age_encryption_recipients=[recipient]).result()  # type: ignore[attr-defined]
    bucket = (stack.settings.storage_url or "").removeprefix("s3://").split("/")[0]
    listed = s3_client(s3_server.url).list_objects_v2(Bucket=bucket)["Contents"]
    exported = [o["Key"] for o in listed if "/external/enc/" in o["Key"]]
    assert exported and all(k.endswith((".age", "carpool-manifest.json")) for k in exported), exported

    _replica(stack, tmp_path / "node-b")
    first.stop(leave=False)  # type: ignore[attr-defined]  # dies without a goodbye
    shutil.rmtree(tmp_path / "node-a")  # and its disk with it: B can only read the bucket
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    losses += _steps(resumed, batches[2:])
    assert losses == pytest.approx(_reference_losses(tiny_model_dir), abs=1e-4)
    assert list((tmp_path / "node-b" / "s3-cache").rglob("carpool_state.safetensors"))  # fetched by B


_UPLOADER = textwrap.dedent("""
    import sys
    from pathlib import Path
    from boto3.s3.transfer import TransferConfig
    from services.storage.s3 import build_s3_store
    endpoint, bucket, uri, folder, cache = sys.argv[1:6]
    store = build_s3_store(f"s3://{bucket}/ckpt", cache_dir=Path(cache), cache_max_bytes=1 << 30,
                           endpoint_url=endpoint)
    # One part at a time, so the test can catch the upload half-way.
    store._transfer = TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20, max_concurrency=1)
    store.upload(uri, Path(folder))
""")


def test_a_process_killed_mid_upload_leaves_nothing_loadable(s3_server: S3Server, s3_bucket: str,
                                                            tmp_path: Path) -> None:
    reader = make_store(s3_server, s3_bucket, tmp_path / "reader")
    uri = reader.uri_for("tenant", "run", "training", "killed")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "adapter_config.json").write_text("{}")
    (folder / "carpool_state.safetensors").write_bytes(os.urandom(64 << 20))
    client = s3_client(s3_server.url)
    process = subprocess.Popen([sys.executable, "-c", _UPLOADER, s3_server.url, s3_bucket, uri, str(folder),
                                str(tmp_path / "writer")], cwd=Path(__file__).resolve().parents[2],
                               env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    try:
        for _ in range(1200):  # wait until parts of the big file are on the server
            uploads = client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads", [])
            if uploads and client.list_parts(Bucket=s3_bucket, Key=uploads[0]["Key"],
                                             UploadId=uploads[0]["UploadId"]).get("Parts"):
                break
            assert process.poll() is None, "the uploader finished before it could be killed"
            time.sleep(0.02)
        process.send_signal(signal.SIGKILL)
    finally:
        process.wait(timeout=30)
    keys = [o["Key"] for o in client.list_objects_v2(Bucket=s3_bucket).get("Contents", [])]
    assert keys and not any(k.endswith("carpool-manifest.json") for k in keys)  # debris, no manifest
    assert not reader.exists(uri) and reader.list_files(uri) == [] and reader.size(uri) == 0
    with pytest.raises(StorageError, match="never completed"):
        reader.fetch(uri)
    assert reader.sweep_incomplete(older_than_s=-1) >= 1
    assert "Contents" not in client.list_objects_v2(Bucket=s3_bucket)
    assert not client.list_multipart_uploads(Bucket=s3_bucket).get("Uploads")
    (folder / "carpool_state.safetensors").write_bytes(b"small now")
    reader.upload(uri, folder)
    assert reader.list_files(uri) == ["adapter_config.json", "carpool_state.safetensors"]
