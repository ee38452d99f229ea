"""Checkpoint stores against one contract (local directory and S3 through a real moto server), plus the
S3 store's own guarantees: manifest-last visibility, sha256 checks, multipart, cache, presigned URLs."""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import pytest

from services.domain.training import AdapterId
from services.storage import CheckpointStore, LocalCheckpointStore, StorageError, UrlSigner
from services.storage.cache import ReadThroughCache
from services.storage.durability import is_scratch
from services.storage.s3 import MANIFEST, S3CheckpointStore
from services.storage.staging import StagedBackend
from tests.s3_support import S3Server, make_store, s3_client

FILES = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"w" * 1000, "sub/x.bin": b"12345"}

Put = Callable[[str, dict[str, bytes]], None]


def _dir(root: Path, files: dict[str, bytes]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return root


@pytest.fixture(params=["local", "s3"])
def store_and_put(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[CheckpointStore, Put]:
    """A store and how a worker writes a checkpoint into it (in place, or staged and uploaded)."""
    if request.param == "local":
        local = LocalCheckpointStore(tmp_path / "ckpt", UrlSigner(b"k" * 32))
        return local, lambda uri, files: _dir(local.local_path(uri), files) and None
    server: S3Server = request.getfixturevalue("s3_server")
    s3 = make_store(server, request.getfixturevalue("s3_bucket"), tmp_path / "cache")
    return s3, lambda uri, files: s3.upload(uri, _dir(s3.staging_dir() / "c", files)) and None


def test_contract_size_list_delete(store_and_put: tuple[CheckpointStore, Put]) -> None:
    store, put = store_and_put
    assert isinstance(store, CheckpointStore)
    uri = store.uri_for("tenant-1", "run:a", "training", "step 1")
    assert not store.exists(uri) and store.size(uri) == 0 and store.list_files(uri) == []
    put(uri, FILES)
    assert store.exists(uri) and store.size(uri) == sum(len(v) for v in FILES.values())
    assert store.list_files(uri) == sorted(FILES)
    assert store.delete(uri) and not store.exists(uri) and not store.delete(uri)


def test_contract_tenants_and_runs_never_share_a_location(store_and_put: tuple[CheckpointStore, Put]) -> None:
    store, put = store_and_put
    a, b = store.uri_for("a", "r", "sampler", "n"), store.uri_for("b", "r", "sampler", "n")
    assert a != b and store.uri_for("a:b", "r", "sampler", "n") != store.uri_for("a_b", "r", "sampler", "n")
    put(a, {"f": b"1"})
    assert store.exists(a) and not store.exists(b)


def test_contract_bad_uris_and_ids_are_refused(store_and_put: tuple[CheckpointStore, Put]) -> None:
    store, _ = store_and_put
    with pytest.raises(StorageError):
        store.uri_for("", "r", "training", "n")
    for uri in ("ftp://x/y", "s3://b/tenants/t/runs/r/weights/n", "local://a/../c/training/d", "s3://"):
        with pytest.raises(StorageError):
            store.local_path(uri)


def test_contract_download_urls_fetch_each_file(store_and_put: tuple[CheckpointStore, Put]) -> None:
    store, put = store_and_put
    uri = store.uri_for("t", "r", "external", "n")
    put(uri, FILES)
    urls = store.download_urls(uri, "http://unused.invalid", datetime.now(UTC) + timedelta(hours=1),
                               version="7.1")
    assert sorted(urls) == sorted(FILES)
    if isinstance(store, LocalCheckpointStore):  # served by the gateway's download route
        for rel, url in urls.items():
            assert store.open_signed(url.rsplit("/", 1)[1]).read_bytes() == FILES[rel]
    else:  # presigned: straight from the bucket, no credentials
        for rel, url in urls.items():
            assert httpx.get(url).content == FILES[rel]


def test_contract_copy_checkpoint(store_and_put: tuple[CheckpointStore, Put]) -> None:
    store, put = store_and_put
    source, target = store.uri_for("t", "r", "training", "a"), store.uri_for("t", "r2", "training", "b")
    with pytest.raises(StorageError, match="no stored files"):
        store.copy_checkpoint(source, target)
    put(source, FILES)
    store.copy_checkpoint(source, target)
    assert store.list_files(target) == sorted(FILES) and store.size(target) == store.size(source)
    assert store.delete(source) and store.exists(target)  # the copy outlives its source


# -- S3 only ----------------------------------------------------------------------------------------
@pytest.fixture
def s3(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> S3CheckpointStore:
    return make_store(s3_server, s3_bucket, tmp_path / "cache")


def _upload(store: S3CheckpointStore, uri: str, files: dict[str, bytes]) -> int:
    return store.upload(uri, _dir(store.staging_dir() / "c", files))


def test_keys_are_scoped_by_tenant_and_run(s3: S3CheckpointStore, s3_server: S3Server) -> None:
    uri = s3.uri_for("tenant-1", "run-9", "training", "w")
    assert uri == f"s3://{s3.location.bucket}/ckpt/tenants/tenant-1/runs/run-9/training/w"
    _upload(s3, uri, {"a": b"1"})
    keys = [o["Key"] for o in s3_client(s3_server.url).list_objects_v2(Bucket=s3.location.bucket)["Contents"]]
    assert sorted(keys) == ["ckpt/tenants/tenant-1/runs/run-9/training/w/a",
                            f"ckpt/tenants/tenant-1/runs/run-9/training/w/{MANIFEST}"]


def test_without_manifest_nothing_is_visible_or_loadable(s3: S3CheckpointStore, s3_server: S3Server) -> None:
    """What a process killed mid-upload leaves: files but no manifest. Invisible, and swept."""
    uri = s3.uri_for("t", "r", "training", "half")
    key = uri.removeprefix(f"s3://{s3.location.bucket}/")
    s3_client(s3_server.url).put_object(Bucket=s3.location.bucket, Key=f"{key}/adapter_model.safetensors",
                                        Body=b"partial")
    assert not s3.exists(uri) and s3.list_files(uri) == [] and s3.size(uri) == 0
    with pytest.raises(StorageError, match="never completed"):
        s3.fetch(uri)
    assert s3.sweep_incomplete(older_than_s=3600) == 0  # too fresh: may be an upload in progress
    assert s3.sweep_incomplete(older_than_s=-1) == 1
    assert "Contents" not in s3_client(s3_server.url).list_objects_v2(Bucket=s3.location.bucket)


def test_corrupted_object_is_refused_on_load(s3: S3CheckpointStore, s3_server: S3Server, tmp_path: Path) -> None:
    uri = s3.uri_for("t", "r", "training", "c")
    _upload(s3, uri, FILES)
    key = uri.removeprefix(f"s3://{s3.location.bucket}/")
    s3_client(s3_server.url).put_object(Bucket=s3.location.bucket, Key=f"{key}/sub/x.bin", Body=b"54321")
    cold = make_store(s3_server, s3.location.bucket, tmp_path / "other-node")
    with pytest.raises(StorageError, match=r"corrupted: x.bin does not match the sha256"):
        cold.fetch(uri)
    assert cold.cache.keys() == []  # nothing half-verified stays in the cache


def test_fetch_on_another_node_and_warm_cache(s3: S3CheckpointStore, s3_server: S3Server, tmp_path: Path) -> None:
    uri = s3.uri_for("t", "r", "sampler", "n")
    _upload(s3, uri, FILES)
    node_b = make_store(s3_server, s3.location.bucket, tmp_path / "node-b")
    first = node_b.fetch(uri)
    assert {p.relative_to(first).as_posix(): p.read_bytes() for p in first.rglob("*")
            if p.is_file() and not p.name.startswith(".")} == FILES
    # Warm: the same directory, no download (the objects are gone but the manifest still matches).
    bucket = s3.location.bucket
    key = uri.removeprefix(f"s3://{bucket}/")
    s3_client(s3_server.url).delete_object(Bucket=bucket, Key=f"{key}/adapter_model.safetensors")
    assert node_b.fetch(uri) == first
    # Overwritten upstream: the manifest changed, so the cache entry is not trusted.
    _upload(s3, uri, {"adapter_config.json": b"new"})
    assert (node_b.fetch(uri) / "adapter_config.json").read_bytes() == b"new"
    assert node_b.list_files(uri) == ["adapter_config.json"]


def test_local_paths_map_back_to_uris_on_any_node(s3: S3CheckpointStore, s3_server: S3Server,
                                                  tmp_path: Path) -> None:
    uri = s3.uri_for("t/x", "r", "training", "n")
    other = make_store(s3_server, s3.location.bucket, tmp_path / "elsewhere")
    assert other.uri_of_local_path(s3.local_path(uri)) == uri
    assert other.uri_of_local_path(tmp_path / "snapshots" / "a") is None
    foreign = make_store(s3_server, s3.location.bucket, tmp_path / "f", prefix="other")
    assert foreign.uri_of_local_path(s3.local_path(uri)) is None


def test_large_files_go_multipart(s3_server: S3Server, s3_bucket: str, tmp_path: Path) -> None:
    store = make_store(s3_server, s3_bucket, tmp_path / "c", multipart_threshold=5 << 20)
    uri = store.uri_for("t", "r", "training", "big")
    big = bytes(range(256)) * (48 * 1024)  # 12 MiB: three parts
    _upload(store, uri, {"adapter_model.safetensors": big})
    key = uri.removeprefix(f"s3://{s3_bucket}/") + "/adapter_model.safetensors"
    etag = s3_client(s3_server.url).head_object(Bucket=s3_bucket, Key=key)["ETag"]
    assert etag.strip('"').endswith("-3")  # S3 marks multipart objects' ETags with their part count
    cold = make_store(s3_server, s3_bucket, tmp_path / "cold")
    assert (cold.fetch(uri) / "adapter_model.safetensors").read_bytes() == big


def test_uploads_carry_the_manifest_sha256_for_the_bucket_to_check(s3: S3CheckpointStore,
                                                                    s3_server: S3Server) -> None:
    """Each file is hashed once: the manifest's sha256 travels with its PutObject (`ChecksumSHA256`), so S3
    refuses a body that does not match the manifest and stores the checksum with the object."""
    uri = s3.uri_for("t", "r", "training", "sum")
    _upload(s3, uri, FILES)
    manifest = s3.manifest(uri)
    assert manifest is not None
    key = uri.removeprefix(f"s3://{s3.location.bucket}/")
    for rel, meta in manifest["files"].items():
        head = s3_client(s3_server.url).head_object(Bucket=s3.location.bucket, Key=f"{key}/{rel}",
                                                    ChecksumMode="ENABLED")
        assert base64.b64decode(head["ChecksumSHA256"]).hex() == meta["sha256"]


def test_staged_saves_are_written_into_scratch_space(s3: S3CheckpointStore) -> None:
    """The staging copy is not fsynced (the save is acknowledged once the bucket holds it)."""
    seen: list[bool] = []

    class Engine:
        def save_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> int:
            seen.append(is_scratch(Path(path).parent))
            _dir(Path(path), FILES)
            return 0

    uri = s3.uri_for("t", "r", "training", "staged")
    StagedBackend(Engine(), s3).save_adapter(AdapterId("a"), s3.local_path(uri), with_optimizer=True)  # type: ignore[arg-type]
    assert seen == [True] and s3.list_files(uri) == sorted(FILES)


def test_s3_down_fails_the_upload_clearly_and_it_works_again_after(s3: S3CheckpointStore,
                                                                   s3_server: S3Server) -> None:
    uri = s3.uri_for("t", "r", "training", "d")
    s3_server.stop()
    try:
        with pytest.raises(StorageError, match="S3 upload of .* failed .*nothing was saved"):
            _upload(s3, uri, FILES)
    finally:
        s3_server.start()  # moto keeps nothing across restarts: the bucket is created anew
        s3_client(s3_server.url).create_bucket(Bucket=s3.location.bucket)
    assert not s3.exists(uri)
    _upload(s3, uri, FILES)
    assert s3.exists(uri)


def test_cache_is_a_bytes_bounded_lru(tmp_path: Path) -> None:
    cache = ReadThroughCache(tmp_path / "c", max_bytes=250)
    for key in ("a", "b"):
        cache.adopt(key, _dir(cache.staging_dir() / "x", {"f": b"1" * 100}), {"k": key})
    assert cache.get("a", {"k": "a"}) is not None  # a is now the most recent
    assert cache.get("a", {"k": "other"}) is None  # a different manifest never hits
    cache.adopt("c", _dir(cache.staging_dir() / "x", {"f": b"1" * 100}), {"k": "c"})
    assert cache.keys() == ["a", "c"] and cache.total_bytes == 200
    assert not cache.entry_path("b").exists()
    reopened = ReadThroughCache(tmp_path / "c", max_bytes=100)  # a restart with a smaller budget
    assert len(reopened.keys()) == 1 and reopened.total_bytes == 100


def test_delete_removes_objects_and_cache(s3: S3CheckpointStore, s3_server: S3Server) -> None:
    uri = s3.uri_for("t", "r", "external", "n")
    _upload(s3, uri, FILES)
    assert s3.cache.keys()
    assert s3.delete(uri)
    assert s3.cache.keys() == [] and "Contents" not in s3_client(s3_server.url).list_objects_v2(
        Bucket=s3.location.bucket)


def test_manifest_lists_size_and_sha256(s3: S3CheckpointStore) -> None:
    uri = s3.uri_for("t", "r", "training", "m")
    _upload(s3, uri, {"a": b"abc"})
    manifest = s3.manifest(uri)
    assert manifest is not None
    abc = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
    assert manifest["files"] == {"a": {"size": 3, "sha256": abc}}
    assert json.loads(json.dumps(manifest)) == manifest


def test_storage_sweep_command(s3: S3CheckpointStore, s3_server: S3Server, monkeypatch: pytest.MonkeyPatch,
                               tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from deploy.cli import app

    uri = s3.uri_for("t", "r", "training", "killed")
    key = uri.removeprefix(f"s3://{s3.location.bucket}/")
    s3_client(s3_server.url).put_object(Bucket=s3.location.bucket, Key=f"{key}/part", Body=b"x")
    _upload(s3, s3.uri_for("t", "r", "training", "whole"), FILES)
    monkeypatch.setenv("CARPOOL_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("CARPOOL_STORAGE_URL", f"s3://{s3.location.bucket}/ckpt")
    monkeypatch.setenv("CARPOOL_S3_ENDPOINT_URL", s3_server.url)
    result = CliRunner().invoke(app, ["storage", "sweep", "--older-than", "0"])
    assert result.exit_code == 0, result.output
    assert "removed 1 objects of incomplete checkpoints" in result.output
    assert s3.list_files(s3.uri_for("t", "r", "training", "whole")) == sorted(FILES)  # complete ones stay


def test_sweeper_removes_killed_upload_debris_by_itself(s3: S3CheckpointStore, s3_server: S3Server,
                                                        tmp_path: Path) -> None:
    """The periodic sweeper (every gateway runs one) calls `sweep_incomplete` with its age threshold: a
    half-upload is kept while it may still be in progress and removed once older than the threshold (the
    sweeper's clock is driven, no sleeps); complete checkpoints stay."""
    from services.control.sweeper import Sweeper, SweepOptions
    from services.db import database_url_for_data_dir, open_database

    killed = s3.uri_for("t", "r", "training", "killed").removeprefix(f"s3://{s3.location.bucket}/")
    s3_client(s3_server.url).put_object(Bucket=s3.location.bucket, Key=f"{killed}/adapter_model.safetensors",
                                        Body=b"partial")
    whole = s3.uri_for("t", "r", "training", "whole")
    _upload(s3, whole, FILES)
    now = [datetime.now(UTC)]
    db = open_database(database_url_for_data_dir(tmp_path), migrate=True)
    try:
        options = SweepOptions(incomplete_upload_age_s=3600, incomplete_sweep_every_s=600)
        sweeper = Sweeper(db, s3, options, clock=lambda: now[0])
        assert sweeper.sweep_once().incomplete_objects_removed == 0  # fresh: may be an upload in progress
        now[0] += timedelta(seconds=3600 + 60)
        assert sweeper.sweep_once().incomplete_objects_removed == 1
    finally:
        db.dispose()
    keys = [o["Key"] for o in s3_client(s3_server.url).list_objects_v2(Bucket=s3.location.bucket)["Contents"]]
    assert not [k for k in keys if k.startswith(f"{killed}/")]
    assert s3.list_files(whole) == sorted(FILES)
