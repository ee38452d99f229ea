"""`Save.clash()`: a save re-run after a crash overwrites its own earlier files; a racing save is refused.

The chaos suite found the case (seed 3): a scheduler and a replica killed after the replica wrote a
checkpoint and before the scheduler stored the result; the successor re-ran the same request and was
answered "already exists" by the directory that very request had written.
"""

from __future__ import annotations

from pathlib import Path

from services.domain.training import AdapterId, WorkError
from services.runtime.commands import CheckpointRecord, Save
from services.storage.local import LocalCheckpointStore, owner_file


class WritingBackend:
    """Writes the checkpoint's files like an engine does (the directory replaced whole)."""

    def __init__(self) -> None:
        self.saves = 0

    def save_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> int:
        self.saves += 1
        path.mkdir(parents=True, exist_ok=True)
        (path / "adapter_model.safetensors").write_bytes(b"x" * self.saves)
        return self.saves


def _save(store: LocalCheckpointStore, token: str, *, overwrite: bool = False) -> Save:
    uri = store.uri_for("t1", "m1", "training", "ckpt")
    record = CheckpointRecord(tenant_id="t1", training_run_id="m1", checkpoint_id="weights/ckpt",
                              kind="training", tinker_path="tinker://m1/weights/ckpt", storage_uri=uri,
                              overwrite=overwrite, save_token=token)
    return Save(AdapterId("m1"), store.local_path(uri), True, "training", record)


def test_a_rerun_of_the_same_submission_overwrites_its_own_attempt(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    backend = WritingBackend()
    first = _save(store, "m1/4")
    assert not isinstance(first.run(backend), WorkError)
    # The successor re-runs the very same command (same submission token) over the files it left.
    again = _save(store, "m1/4").run(backend)
    assert not isinstance(again, WorkError), again
    assert backend.saves == 2


def test_another_submission_of_the_same_name_is_refused(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    backend = WritingBackend()
    assert not isinstance(_save(store, "m1/4").run(backend), WorkError)
    racing = _save(store, "m1/5").run(backend)
    assert isinstance(racing, WorkError) and racing.category == "user" and "already exists" in racing.message
    untokened = _save(store, "").run(backend)  # a directory of unknown origin is never taken over
    assert isinstance(untokened, WorkError)
    assert backend.saves == 1
    assert not isinstance(_save(store, "m1/6", overwrite=True).run(backend), WorkError)


def test_a_directory_without_an_owner_is_refused_and_delete_removes_the_owner(tmp_path: Path) -> None:
    store = LocalCheckpointStore(tmp_path)
    backend = WritingBackend()
    save = _save(store, "m1/4")
    save.path.mkdir(parents=True)  # e.g. written by a version before tokens, or by hand
    assert isinstance(save.run(backend), WorkError)
    owner_file(save.path).unlink(missing_ok=True)
    save.path.rmdir()
    assert not isinstance(save.run(backend), WorkError)
    assert owner_file(save.path).read_text() == "m1/4"
    assert store.delete(save.record.storage_uri)
    assert not owner_file(save.path).exists() and not save.path.exists()
    assert not isinstance(_save(store, "m1/9").run(backend), WorkError)  # the name is free again
