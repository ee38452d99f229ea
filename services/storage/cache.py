"""`ReadThroughCache`: a bytes-bounded LRU of checkpoint directories on one node's local disk.

A remote store (S3) downloads a checkpoint once into `<root>/entries/<key>/` and serves later loads from
there, so reloading a hot adapter costs no download. Each entry keeps the manifest it was filled from
(`.manifest.json`); the store compares it with the remote manifest before trusting the entry, so an
overwritten checkpoint is never served stale. Entries are filled in `<root>/staging/` and renamed into
place, so a crash mid-download leaves no half entry. When the total size passes `max_bytes` the least
recently used entries are removed (an entry being returned is never the one evicted).

Entries are written without fsync (the bucket holds the durable copy; see `services.storage.durability`),
so after a crash or power loss an entry's files may be torn while its manifest looks complete. Entries
this process filled are trusted; entries inherited from an earlier process are checked against their
manifest's sizes and sha256 once, on first use, and dropped (then downloaded again) if anything differs.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from pathlib import Path
from typing import Any

from services.storage.s3_transfer import sha256_file

ENTRY_MANIFEST = ".manifest.json"
STALE_STAGING_S = 3600.0


def _dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file() and f.name != ENTRY_MANIFEST)


def _matches(path: Path, manifest: dict[str, Any]) -> bool:
    """Whether every file the manifest lists is in `path` with its size and sha256."""
    try:
        return all((path / rel).stat().st_size == int(meta["size"]) and sha256_file(path / rel) == meta["sha256"]
                   for rel, meta in dict(manifest["files"]).items())
    except (OSError, KeyError, TypeError, ValueError):
        return False


class ReadThroughCache:
    """Checkpoint directories by key (a `/`-separated relative path), at most `max_bytes` in total."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        if max_bytes < 0:
            raise ValueError(f"cache max_bytes must be >= 0, got {max_bytes}")
        self.root = Path(root).resolve()
        self.max_bytes = max_bytes
        self._entries_root = self.root / "entries"
        self._staging_root = self.root / "staging"
        self._entries_root.mkdir(parents=True, exist_ok=True)
        self._staging_root.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._inherited: set[str] = set()
        """Keys found on disk at start: not yet checked against their manifest in this process."""
        self._scan()

    @property
    def total_bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def keys(self) -> list[str]:
        """Cached keys, least recently used first."""
        with self._lock:
            return list(self._sizes)

    def entry_path(self, key: str) -> Path:
        return self._entries_root.joinpath(*key.split("/"))

    def staging_dir(self) -> Path:
        """A fresh private directory to build an entry in (same filesystem as the entries: renames are atomic)."""
        return Path(tempfile.mkdtemp(prefix="fill-", dir=self._staging_root))

    def get(self, key: str, manifest: dict[str, object]) -> Path | None:
        """The entry for `key` if it was filled from exactly `manifest`; marks it recently used."""
        path = self.entry_path(key)
        try:
            cached = json.loads((path / ENTRY_MANIFEST).read_text())
        except (OSError, ValueError):
            return None
        if cached != manifest:
            return None
        if key in self._inherited:
            if not _matches(path, manifest):
                self.discard(key)
                return None
            self._inherited.discard(key)
        with self._lock:
            if key in self._sizes:
                self._sizes.move_to_end(key)
        return path

    def adopt(self, key: str, filled: Path, manifest: dict[str, object]) -> Path:
        """Move the finished directory `filled` in as the entry for `key` (replacing an older one)."""
        (filled / ENTRY_MANIFEST).write_text(json.dumps(manifest, sort_keys=True))
        size = _dir_bytes(filled)
        path = self.entry_path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            self._remove_locked(key)
            os.rename(filled, path)
            self._inherited.discard(key)
            self._sizes[key] = size
            self._evict_locked(keep=key)
        return path

    def discard(self, key: str) -> None:
        with self._lock:
            self._remove_locked(key)

    # -- internals --------------------------------------------------------------------------------
    def _remove_locked(self, key: str) -> None:
        self._sizes.pop(key, None)
        self._inherited.discard(key)
        path = self.entry_path(key)
        if path.exists():
            # Rename first: a reader that already holds the path keeps complete files until we delete.
            doomed = Path(tempfile.mkdtemp(prefix="evict-", dir=self._staging_root))
            os.rename(path, doomed / "entry")
            shutil.rmtree(doomed, ignore_errors=True)

    def _evict_locked(self, keep: str) -> None:
        total = sum(self._sizes.values())
        for key in list(self._sizes):
            if total <= self.max_bytes:
                break
            if key == keep:
                continue
            total -= self._sizes[key]
            self._remove_locked(key)

    def _scan(self) -> None:
        """Pick up entries a previous process left (oldest first by mtime); drop stale staging dirs."""
        # Another process on this node may be filling right now: only leftovers of a crash are removed.
        cutoff = time.time() - STALE_STAGING_S
        for leftover in self._staging_root.iterdir():
            if leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        found = sorted(self._entries_root.rglob(ENTRY_MANIFEST), key=lambda p: p.stat().st_mtime)
        for marker in found:
            entry = marker.parent
            key = entry.relative_to(self._entries_root).as_posix()
            self._sizes[key] = _dir_bytes(entry)
            self._inherited.add(key)
        self._evict_locked(keep="")
