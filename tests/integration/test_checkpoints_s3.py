"""Checkpoints on S3 through the whole service (control plane, scheduler loop, real engine, moto server).

Two "nodes" (control plane + loop + engine each, separate data and cache directories, one database and one
bucket): a tenant saves on node A, the model moves to node B, which loads it from the bucket and continues
with the losses an uninterrupted run has. S3 down during a save fails only that save (category `server`);
training goes on and the next save works once S3 is back. A corrupted object is refused on load.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import BASE, Harness, build_harness

from services.auth.tenants import Tenant
from services.control.api import CheckpointRef, Failed, SaveOptions, WeightsLoaded
from services.db import database_url_for_data_dir
from services.db.ids import ModelId, SessionId
from services.domain.training import AdamParams, Datum, ForwardBackwardResult, ForwardBackwardWork, LoraSpec
from services.storage.s3 import S3CheckpointStore
from tests.s3_support import S3Server, make_store, s3_client

SPEC = LoraSpec(rank=4, seed=3)
HP = AdamParams(learning_rate=2e-2)


def _batches(n: int) -> list[list[Datum]]:
    rng = np.random.default_rng(7)
    out = []
    for _ in range(n):
        seqs = [rng.integers(0, 512, k + 1) for k in (9, 5)]
        out.append([Datum(s[:-1], {"target_tokens": s[1:], "weights": np.ones(len(s) - 1, np.float32)})
                    for s in seqs])
    return out


def _step(h: Harness, t: Tenant, model: ModelId, seq: int, batch: list[Datum]) -> float:
    fb = h.run(h.control.forward_backward(t, model, seq, ForwardBackwardWork(None, batch)))
    h.run(h.control.optim_step(t, model, seq + 1, HP))
    result = h.done(t, fb.request_id)
    assert isinstance(result, ForwardBackwardResult)
    return float(result.metrics["loss:sum"])


@pytest.fixture
def nodes(tiny_model_dir: Path, tmp_path: Path, s3_server: S3Server,
          s3_bucket: str) -> Iterator[tuple[Harness, Harness]]:
    url = database_url_for_data_dir(tmp_path / "shared-db")
    (tmp_path / "shared-db").mkdir()
    built = []
    for name in ("a", "b"):
        store = make_store(s3_server, s3_bucket, tmp_path / name / "s3-cache", timeout_s=2.0, max_attempts=1)
        built.append(build_harness(url, tiny_model_dir, tmp_path / name, store=store))
    yield built[0], built[1]
    for h in built:
        h.close()


def test_save_on_one_node_load_and_continue_on_another(nodes: tuple[Harness, Harness]) -> None:
    a, b = nodes
    t = a.tenant("acme")
    s = a.session(t)
    batches = _batches(4)
    straight = a.run(a.control.create_model(t, s, 0, BASE, SPEC, None)).model_id
    moved = a.run(a.control.create_model(t, s, 1, BASE, SPEC, None)).model_id
    reference = [_step(a, t, straight, 1 + 2 * i, batch) for i, batch in enumerate(batches)]

    first = [_step(a, t, moved, 1 + 2 * i, batch) for i, batch in enumerate(batches[:2])]
    save = a.run(a.control.save(t, moved, 5, "training", SaveOptions(name="half")))
    ref = a.done(t, save.request_id)
    assert isinstance(ref, CheckpointRef) and (ref.size_bytes or 0) > 0
    assert isinstance(a.store, S3CheckpointStore) and a.store.exists(a.store.uri_for(t.id, moved, "training",
                                                                                      "half"))
    assert not b.store.local_path(b.store.uri_for(t.id, moved, "training", "half")).exists()  # B's own disk

    loaded = b.run(b.control.load(t, path=ref.tinker_path, with_optimizer=True, session_id=SessionId(s),
                                  model_seq_id=2))
    assert isinstance(b.done(t, loaded.request_id), WeightsLoaded)
    rest = [_step(b, t, loaded.model_id, 1 + 2 * i, batch) for i, batch in enumerate(batches[2:])]
    assert first + rest == pytest.approx(reference, abs=1e-5)
    usage = b.run(b.control.usage(t))
    assert usage["checkpoint_bytes"] == ref.size_bytes


def test_s3_down_fails_only_the_save(nodes: tuple[Harness, Harness], s3_server: S3Server) -> None:
    a, _ = nodes
    t = a.tenant("acme")
    model = a.run(a.control.create_model(t, a.session(t), 0, BASE, SPEC, None)).model_id
    batches = _batches(3)
    _step(a, t, model, 1, batches[0])
    s3_server.stop()
    try:
        save = a.run(a.control.save(t, model, 3, "training", SaveOptions(name="down")))
        failed = a.result(t, save.request_id)
        assert isinstance(failed, Failed) and failed.category == "server"
        assert "S3 upload of" in failed.error and "nothing was saved" in failed.error
        _step(a, t, model, 4, batches[1])  # the adapter keeps training
    finally:
        s3_server.start()
        assert isinstance(a.store, S3CheckpointStore)
        s3_client(s3_server.url).create_bucket(Bucket=a.store.location.bucket)
    again = a.run(a.control.save(t, model, 6, "training", SaveOptions(name="down")))
    assert isinstance(a.done(t, again.request_id), CheckpointRef)
    views, _ = a.run(a.control.list_checkpoints(t, model, 10, 0))
    assert [v.checkpoint_id for v in views] == ["weights/down"]


def test_corrupted_checkpoint_is_refused_on_load(nodes: tuple[Harness, Harness], s3_server: S3Server) -> None:
    a, b = nodes
    t = a.tenant("acme")
    s = a.session(t)
    model = a.run(a.control.create_model(t, s, 0, BASE, SPEC, None)).model_id
    save = a.run(a.control.save(t, model, 1, "training", SaveOptions(name="c")))
    ref = a.done(t, save.request_id)
    assert isinstance(a.store, S3CheckpointStore)
    uri = a.store.uri_for(t.id, model, "training", "c")
    key = uri.removeprefix(f"s3://{a.store.location.bucket}/") + "/adapter_model.safetensors"
    s3_client(s3_server.url).put_object(Bucket=a.store.location.bucket, Key=key, Body=b"not the weights")
    loaded = b.run(b.control.load(t, path=ref.tinker_path, with_optimizer=True, session_id=SessionId(s),
                                  model_seq_id=1))
    failed = b.result(t, loaded.request_id)
    assert isinstance(failed, Failed)
    assert "corrupted" in failed.error and "adapter_model.safetensors" in failed.error


def _encrypted_export(h: Harness, recipient: str) -> str:
    """A fresh adapter (seeded: the same weights on every node) exported age-encrypted; its storage URI."""
    from services.control.training import ExternalSaveOptions

    t = h.tenant("acme")
    model = h.run(h.control.create_model(t, h.session(t), 0, BASE, SPEC, None)).model_id
    save = h.run(h.control.save(t, model, 1, "external", ExternalSaveOptions(name="x", age_recipients=(recipient,))))
    assert isinstance(h.done(t, save.request_id), CheckpointRef)
    return h.store.uri_for(t.id, model, "external", "x")


def _decrypted(files: dict[str, bytes], identity: object) -> dict[str, bytes]:
    import pyrage

    assert all(name.endswith(".age") and body.startswith(b"age-encryption.org/v1") for name, body in files.items())
    return {name.removesuffix(".age"): pyrage.decrypt(body, [identity]) for name, body in files.items()}


def test_encrypted_export_on_s3_decrypts_to_the_local_stores_files(nodes: tuple[Harness, Harness],
                                                                   s3_server: S3Server, tiny_model_dir: Path,
                                                                   tmp_path: Path) -> None:
    """Encrypted on the saving node before the upload: the bucket holds only ciphertext, and what the SDK
    (tinker_cookbook.weights.download) fetches through the presigned URLs decrypts to the local export's files."""
    from datetime import UTC, datetime, timedelta

    import httpx
    import pyrage

    identity = pyrage.x25519.Identity.generate()
    recipient = str(identity.to_public())
    a, _ = nodes
    uri = _encrypted_export(a, recipient)
    assert isinstance(a.store, S3CheckpointStore)
    keys = [o["Key"] for o in s3_client(s3_server.url).list_objects_v2(Bucket=a.store.location.bucket)["Contents"]]
    assert keys and all(k.endswith((".age", "carpool-manifest.json")) for k in keys)  # no plaintext uploaded
    urls = a.store.download_urls(uri, "http://unused", datetime.now(UTC) + timedelta(minutes=5))
    from_s3 = _decrypted({name: httpx.get(url).raise_for_status().content for name, url in urls.items()}, identity)

    (tmp_path / "local").mkdir()
    local = build_harness(database_url_for_data_dir(tmp_path / "local"), tiny_model_dir, tmp_path / "local")
    try:
        folder = local.store.local_path(_encrypted_export(local, recipient))
        from_local = _decrypted({f.name: f.read_bytes() for f in folder.iterdir()}, identity)
    finally:
        local.close()
    assert sorted(from_s3) == ["adapter_config.json", "adapter_model.safetensors"]
    assert from_s3 == from_local


def test_ttl_expiry_removes_the_objects(nodes: tuple[Harness, Harness], s3_server: S3Server) -> None:
    from datetime import timedelta

    from services.control.sweeper import Sweeper
    from services.db.columns import utcnow

    a, _ = nodes
    t = a.tenant("acme")
    model = a.run(a.control.create_model(t, a.session(t), 0, BASE, SPEC, None)).model_id
    save = a.run(a.control.save(t, model, 1, "sampler", SaveOptions(name="ttl", ttl_seconds=60)))
    assert isinstance(a.done(t, save.request_id), CheckpointRef)
    assert isinstance(a.store, S3CheckpointStore)
    bucket = a.store.location.bucket
    assert s3_client(s3_server.url).list_objects_v2(Bucket=bucket)["KeyCount"] > 0
    report = Sweeper(a.db, a.store, clock=lambda: utcnow() + timedelta(hours=1)).sweep_once()
    assert report.checkpoints_deleted == 1 and report.files_failed == 0
    assert s3_client(s3_server.url).list_objects_v2(Bucket=bucket)["KeyCount"] == 0


def test_hub_push_of_an_s3_checkpoint_from_another_node(nodes: tuple[Harness, Harness]) -> None:
    from services.db.hub_pushes import create_hub_push, get_hub_push, put_hub_credential
    from services.hub.clients import HuggingFaceClient
    from services.hub.credentials import TokenCipher
    from services.hub.runner import Finished, PushRunner
    from tests.hub_fakes import FakeHfApi

    a, b = nodes
    t = a.tenant("acme")
    model = a.run(a.control.create_model(t, a.session(t), 0, BASE, SPEC, None)).model_id
    ref = a.done(t, a.run(a.control.save(t, model, 1, "training", SaveOptions(name="pushed"))).request_id)
    assert isinstance(ref, CheckpointRef)
    cipher, hub = TokenCipher(b"k" * 32), FakeHfApi()
    with b.db.sessions.begin() as db:
        put_hub_credential(db, t.id, "hf", cipher.encrypt("hf_token"))  # type: ignore[arg-type]
        push_id = create_hub_push(db, t.id, ref.tinker_path, target="hf", repo="acme/s3").id  # type: ignore[arg-type]
    runner = PushRunner(b.db, b.store, {"hf": HuggingFaceClient(hub)}, cipher)
    assert runner.run(push_id, 0) == Finished("done")
    assert sorted(hub.repos["acme/s3"].files) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    assert isinstance(b.store, S3CheckpointStore) and b.store.cache.keys()  # fetched (and verified) by node B
    with b.db.sessions.begin() as db:
        assert get_hub_push(db, t.id, push_id).status == "done"  # type: ignore[arg-type, union-attr]
