"""Checkpoint storage: the local layout, filesystem-safe names, sizes and listings, and signed tokens."""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from services.storage import (
    CheckpointStore,
    InvalidToken,
    LocalCheckpointStore,
    StorageError,
    UrlSigner,
    load_or_create_secret,
    safe_component,
)

SECRET = b"s" * 32
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def _write(path: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(data)


def test_layout_is_tenant_run_kind_name(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path / "ckpt")
    assert isinstance(store, CheckpointStore)
    uri = store.uri_for("tenant-1", "sess-a:train:0", "training", "step 10")
    assert uri == "local://tenant-1/sess-a%3Atrain%3A0/training/step%2010"
    assert (
        store.local_path(uri)
        == (tmp_path / "ckpt" / "tenant-1" / "sess-a%3Atrain%3A0" / "training" / "step%2010").resolve()
    )


@pytest.mark.parametrize("value", ["a:b", "a_b", "a%3Ab", "../x", ".hidden", "x/y", "é", "~"])
def test_safe_components_are_distinct_and_contained(value: str) -> None:
    name = safe_component(value)
    assert "/" not in name and not name.startswith(".") and name not in ("", ".", "..")
    others = {"a:b", "a_b", "a%3Ab", "../x", ".hidden", "x/y", "é", "~"} - {value}
    assert all(safe_component(other) != name for other in others)


def test_empty_ids_and_foreign_uris_are_refused(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    with pytest.raises(StorageError):
        store.uri_for("", "run", "training", "n")
    for uri in (
        "s3://bucket/x",
        "local://a/b/weights/c",
        "local://a/../c/training/d",
        "local://a/b/training",
    ):
        with pytest.raises(StorageError):
            store.local_path(uri)


def test_size_list_and_delete(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    uri = store.uri_for("t", "r", "external", "n")
    assert not store.exists(uri) and store.size(uri) == 0 and store.list_files(uri) == []
    _write(store.local_path(uri), {"adapter_config.json": b"{}", "sub/weights.bin": b"12345"})
    assert store.exists(uri) and store.size(uri) == 7
    assert store.list_files(uri) == ["adapter_config.json", "sub/weights.bin"]
    assert store.delete(uri) and not store.exists(uri) and not store.delete(uri)


def test_signing_round_trip_and_expiry() -> None:
    now = [NOW.timestamp()]
    signer = UrlSigner(SECRET, clock=lambda: now[0])
    token = signer.sign("t/r/external/n/adapter_config.json", NOW + timedelta(hours=1))
    assert signer.verify(token) == "t/r/external/n/adapter_config.json"
    now[0] += 3600
    with pytest.raises(InvalidToken, match="expired"):
        signer.verify(token)


def test_forged_and_malformed_tokens_are_refused() -> None:
    signer = UrlSigner(SECRET, clock=lambda: NOW.timestamp())
    token = signer.sign("a/file", NOW + timedelta(hours=1))
    payload, mac = token.split(".")
    other = UrlSigner(b"o" * 32, clock=lambda: NOW.timestamp()).sign("b/file", NOW + timedelta(hours=1))
    # Non-ASCII too (make fuzz sent `%C2%80.0`: the MAC of a non-ASCII payload raised, a 500).
    for bad in (f"{other.split('.')[0]}.{mac}", f"{payload}.{mac[:-2]}xx", "nodot", ".", "a.b", token + "x",
                "\x80.0", f"{payload}\u00e9.{mac}", f"{payload}.{mac[:-1]}\u00e9"):
        with pytest.raises(InvalidToken):
            signer.verify(bad)
    with pytest.raises(ValueError):
        UrlSigner(b"short")


def test_download_urls_open_only_their_own_file(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path / "root", UrlSigner(SECRET))
    uri = store.uri_for("t", "r", "external", "n")
    _write(store.local_path(uri), {"adapter_model.safetensors": b"weights"})
    urls = store.download_urls(uri, "https://carpool.example/base/", datetime.now(UTC) + timedelta(hours=1))
    url = urls["adapter_model.safetensors"]
    assert url.startswith("https://carpool.example/base/api/v1/download/")
    assert store.open_signed(url.rsplit("/", 1)[1]).read_bytes() == b"weights"
    store.delete(uri)
    with pytest.raises(InvalidToken):
        store.open_signed(url.rsplit("/", 1)[1])
    escaping = UrlSigner(SECRET).sign("../outside", datetime.now(UTC) + timedelta(hours=1))
    with pytest.raises(InvalidToken):
        store.open_signed(escaping)
    with pytest.raises(StorageError):
        LocalCheckpointStore(tmp_path / "unsigned").download_urls(uri, "http://x", datetime.now(UTC))


def test_secret_is_created_once_and_private(tmp_path: Path) -> None:
    path = tmp_path / "secrets" / "url-signing.key"
    first = load_or_create_secret(path)
    assert len(first) == 32 and load_or_create_secret(path) == first
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    path.write_text("not hex")
    with pytest.raises(ValueError, match="delete it"):
        load_or_create_secret(path)
