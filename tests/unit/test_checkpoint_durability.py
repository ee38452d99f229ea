"""Checkpoints are on disk before they are acknowledged, and staged copies that are not are never trusted.

- A local save (`write_checkpoint`, what `Engine.save_adapter` calls) fsyncs every file, the new directory
  and, after the rename, its parent: recorded by wrapping `os.fsync`, so a missing call fails here rather
  than losing a tenant's checkpoint to a power cut.
- A save into a scratch directory (an S3 staging copy: the bucket is the durable copy) skips the fsyncs.
- `LocalCheckpointStore.copy_checkpoint` (a copy the tenant is told is done) is durable too.
- The S3 read-through cache re-verifies entries left by an earlier process (they were written without
  fsync, so a crash may have torn them) against their manifest before serving them.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from services.domain.training import LoraSpec
from services.storage import LocalCheckpointStore
from services.storage.cache import ReadThroughCache
from services.storage.durability import mark_scratch
from worker.engine.adapters import OptimizerState
from worker.engine.checkpoints import AdapterSnapshot, read_checkpoint, write_checkpoint

LAYER = "model.layers.0.self_attn.q_proj"
FILES = ("adapter_config.json", "adapter_model.safetensors", "carpool_state.safetensors", "carpool_state.json")


def _snapshot() -> AdapterSnapshot:
    gen = torch.Generator().manual_seed(0)
    params = {f"{LAYER}.lora_A": torch.randn(2, 8, generator=gen), f"{LAYER}.lora_B": torch.randn(8, 2, generator=gen)}
    moments = OptimizerState(3, {k: t * 0.1 for k, t in params.items()}, {k: t * t for k, t in params.items()})
    return AdapterSnapshot(spec=LoraSpec(rank=2, seed=7, train_attn=True, train_mlp=False), params=params,
                           base_model="tiny", optimizer=moments)


@pytest.fixture
def fsynced(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every path `os.fsync` is called on, in call order (resolved through /proc/self/fd at call time)."""
    calls: list[Path] = []
    real: Callable[[int], None] = os.fsync

    def record(fd: int) -> None:
        calls.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
        real(fd)

    monkeypatch.setattr(os, "fsync", record)
    return calls


def test_a_local_save_fsyncs_files_directory_and_rename_before_returning(tmp_path: Path,
                                                                         fsynced: list[Path]) -> None:
    target = tmp_path / "run" / "step-1"
    write_checkpoint(_snapshot(), target)
    assert sorted(p.name for p in target.iterdir()) == sorted(FILES)
    # Files and their directory are synced under the temporary name, before it is renamed into place.
    temp_dir = fsynced[len(FILES)]
    assert temp_dir.parent == target.parent and temp_dir.name.startswith(".step-1.tmp-")
    assert sorted(fsynced[: len(FILES)]) == sorted(temp_dir / name for name in FILES)
    assert fsynced[len(FILES) + 1:] == [target.parent]  # last: the rename itself
    assert read_checkpoint(target, with_optimizer=True).optimizer is not None


def test_an_overwrite_is_durable_too(tmp_path: Path, fsynced: list[Path]) -> None:
    target = tmp_path / "step"
    write_checkpoint(_snapshot(), target)
    fsynced.clear()
    write_checkpoint(_snapshot(), target)
    assert len(fsynced) == len(FILES) + 2 and fsynced[-1] == tmp_path
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]  # the old copy is gone


def test_a_save_into_scratch_space_is_not_fsynced(tmp_path: Path, fsynced: list[Path]) -> None:
    staging = tmp_path / "fill-1"
    staging.mkdir()
    mark_scratch(staging)
    write_checkpoint(_snapshot(), staging / "checkpoint")
    assert fsynced == []
    assert sorted(p.name for p in (staging / "checkpoint").iterdir()) == sorted(FILES)


def test_copy_checkpoint_is_durable_and_never_half_visible(tmp_path: Path, fsynced: list[Path]) -> None:
    store = LocalCheckpointStore(tmp_path / "ckpt")
    source, target = store.uri_for("t", "r", "training", "a"), store.uri_for("t", "r", "sampler", "b")
    write_checkpoint(_snapshot(), store.local_path(source))
    fsynced.clear()
    store.copy_checkpoint(source, target)
    copied = store.local_path(target)
    assert store.list_files(target) == sorted(FILES)
    assert {p.name for p in fsynced if p.parent.name.startswith(".b.tmp-")} == set(FILES)
    assert fsynced[-1] == copied.parent  # the rename into place, after the files and the directory
    assert [p.name for p in copied.parent.iterdir()] == ["b"]  # no temporary directory left behind
    with pytest.raises(FileExistsError):
        store.copy_checkpoint(source, target)


def _entry(cache: ReadThroughCache, key: str, data: bytes) -> dict[str, object]:
    filled = cache.staging_dir()
    (filled / "f.bin").write_bytes(data)
    manifest: dict[str, object] = {"files": {"f.bin": {"size": len(data),
                                                       "sha256": hashlib.sha256(data).hexdigest()}}}
    cache.adopt(key, filled, manifest)
    return manifest


def test_cache_entries_from_an_earlier_process_are_verified_before_use(tmp_path: Path) -> None:
    cache = ReadThroughCache(tmp_path / "c", max_bytes=1 << 20)
    good, torn = _entry(cache, "good", b"a" * 100), _entry(cache, "torn", b"b" * 100)
    (cache.entry_path("torn") / "f.bin").write_bytes(b"\0" * 100)  # what a power cut can leave: right size
    assert cache.get("torn", torn) is not None  # filled by this process: trusted, not re-read
    restarted = ReadThroughCache(tmp_path / "c", max_bytes=1 << 20)
    assert restarted.get("good", good) == restarted.entry_path("good")
    assert restarted.get("torn", torn) is None  # refused and dropped: the next load downloads it again
    assert restarted.keys() == ["good"] and not restarted.entry_path("torn").exists()
