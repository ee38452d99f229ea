"""When checkpoint bytes are durable on local disk: fsync helpers and the scratch-directory marker.

A local checkpoint is acknowledged to the tenant once its directory is in place, so its files, the
directory itself (the names of its files) and the parent (the rename that put it in place) must all reach
the disk first: otherwise a power loss after the acknowledgement can lose a checkpoint the tenant was told
is saved. `fsync_file`, `fsync_dir` and `fsync_tree` do that.

A *scratch* directory is the exception: its contents are made durable somewhere else. A worker on S3
storage writes each checkpoint into a private staging directory and acknowledges it only once the bucket
holds every byte and the manifest; forcing the staging files to the local disk first would only delay
the upload. `mark_scratch` drops `SCRATCH_MARKER` in such a directory, and checkpoint writers skip the
fsync for a checkpoint whose parent `is_scratch`. The copy left behind is only ever a cache entry, and
`ReadThroughCache` re-verifies entries inherited from an earlier process against their manifest's sha256
before it serves them (see `services.storage.cache`), so a torn file after a crash is never loaded.
"""

from __future__ import annotations

import os
from pathlib import Path

SCRATCH_MARKER = ".carpool-scratch"
"""A file in a directory whose checkpoints are staged for upload (never the durable copy)."""


def fsync_file(path: Path) -> None:
    """Force one file's data and size to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Force a directory's entries (creations, renames, removals inside it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """Every file and directory under `root`, and `root` itself, forced to disk (children first)."""
    root = Path(root)
    for current, dirs, files in os.walk(root, topdown=False):
        for name in files:
            fsync_file(Path(current) / name)
        for name in dirs:
            fsync_dir(Path(current) / name)
    fsync_dir(root)


def mark_scratch(directory: Path) -> None:
    """Mark `directory` as staging space: checkpoints written into it are not fsynced (see the module)."""
    (Path(directory) / SCRATCH_MARKER).touch()


def is_scratch(directory: Path) -> bool:
    return (Path(directory) / SCRATCH_MARKER).is_file()
