"""`LocalCheckpointStore`: checkpoints as directories under one root, plus signed download tokens for them.

Layout: `<root>/<tenant>/<training_run_id>/<kind>/<name>/`, each component made filesystem-safe by a
reversible escape (see `safe_component`), so distinct ids never share a directory and no id can climb out
of the root. URIs are `local://<tenant>/<run>/<kind>/<name>` with the escaped components: relative to the
root, so a data dir can be moved without rewriting the database.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from datetime import datetime
from pathlib import Path
from urllib.parse import quote

from services.storage.durability import fsync_dir, fsync_tree
from services.storage.protocol import CHECKPOINT_KINDS, CheckpointKind, InvalidToken, StorageError
from services.storage.signing import UrlSigner

URI_SCHEME = "local://"
DOWNLOAD_ROUTE = "/api/v1/download/"
# What may appear unescaped in a directory name; everything else becomes %XX (UTF-8 bytes).
_SAFE_CHARS = "-_"
_ESCAPED = re.compile(r"^[A-Za-z0-9._~%-]+$")


def safe_component(value: str) -> str:
    """`value` as one directory name: percent-escaped, never empty, `.`/`..` or hidden.

    Escaping (not replacing) keeps the mapping one-to-one: `a:b` and `a_b` stay different directories.
    A leading dot is escaped too, so names can never collide with the writers' `.<name>.tmp-*` siblings.
    """
    if not value:
        raise StorageError("an id used in a storage path must not be empty")
    escaped = quote(value, safe=_SAFE_CHARS + ".")
    if escaped.startswith("."):
        escaped = "%2E" + escaped[1:]
    return escaped


class LocalCheckpointStore:
    """`CheckpointStore` over a local directory tree; `signer` enables download URLs."""

    remote = False
    """Paths are the checkpoint's own files (an S3 store's are a cache that workers fill)."""

    def __init__(self, root: Path, signer: UrlSigner | None = None) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        self._signer = signer

    # -- addressing -------------------------------------------------------------------------------
    def uri_for(self, tenant_id: str, training_run_id: str, kind: CheckpointKind, name: str) -> str:
        if kind not in CHECKPOINT_KINDS:
            raise StorageError(f"unknown checkpoint kind {kind!r}")
        parts = (safe_component(tenant_id), safe_component(training_run_id), kind, safe_component(name))
        return URI_SCHEME + "/".join(parts)

    def local_path(self, uri: str) -> Path:
        return self.root.joinpath(*self._key(uri).split("/"))

    # -- contents ---------------------------------------------------------------------------------
    def exists(self, uri: str) -> bool:
        return self.local_path(uri).is_dir()

    def delete(self, uri: str) -> bool:
        path = self.local_path(uri)
        if not path.exists():
            return False
        shutil.rmtree(path)
        owner_file(path).unlink(missing_ok=True)
        return True

    def size(self, uri: str) -> int:
        path = self.local_path(uri)
        return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0

    def list_files(self, uri: str) -> list[str]:
        path = self.local_path(uri)
        if not path.is_dir():
            return []
        return sorted(f.relative_to(path).as_posix() for f in path.rglob("*") if f.is_file())

    def copy_checkpoint(self, source_uri: str, target_uri: str) -> None:
        source = self.local_path(source_uri)
        if not source.is_dir():
            raise StorageError(f"checkpoint {source_uri} has no stored files")
        target = self.local_path(target_uri)
        if target.exists():
            raise FileExistsError(f"checkpoint {target_uri} already exists")
        target.parent.mkdir(parents=True, exist_ok=True)
        # Copied beside the target, forced to disk, then renamed: the copy is acknowledged once this
        # returns, so a crash must leave either no checkpoint or the complete one.
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            shutil.copytree(source, tmp, dirs_exist_ok=True)
            fsync_tree(tmp)
            os.rename(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        fsync_dir(target.parent)

    # -- downloads --------------------------------------------------------------------------------
    def download_urls(self, uri: str, base_url: str, expires_at: datetime, *,
                      version: str | None = None) -> dict[str, str]:
        signer = self._require_signer()
        key = self._key(uri)
        prefix = base_url.rstrip("/") + DOWNLOAD_ROUTE
        return {rel: prefix + signer.sign(f"{key}/{rel}", expires_at, version=version)
                for rel in self.list_files(uri)}

    def open_signed(self, token: str) -> Path:
        """The file a download token names; raises `InvalidToken` if the token or the file is not good."""
        relative = self._require_signer().verify(token)
        path = (self.root / relative).resolve()
        # A valid token only ever names a file under the root; the check guards against a leaked secret.
        if not path.is_relative_to(self.root) or not path.is_file():
            raise InvalidToken("the file this download token names does not exist any more")
        return path

    # -- internals --------------------------------------------------------------------------------
    def _require_signer(self) -> UrlSigner:
        if self._signer is None:
            raise StorageError("this checkpoint store was built without a URL signer")
        return self._signer

    @staticmethod
    def _key(uri: str) -> str:
        """The root-relative path of a URI, after checking it has the shape `uri_for` produces."""
        if not uri.startswith(URI_SCHEME):
            raise StorageError(f"not a local storage URI: {uri!r}")
        parts = uri[len(URI_SCHEME):].split("/")
        if len(parts) != 4 or parts[2] not in CHECKPOINT_KINDS:
            raise StorageError(f"malformed local storage URI: {uri!r}")
        if not all(_ESCAPED.fullmatch(p) and not p.startswith(".") for p in parts):
            raise StorageError(f"malformed local storage URI: {uri!r}")
        return "/".join(parts)


def owner_file(path: Path) -> Path:
    """The sidecar naming the submission that wrote the checkpoint at `path` (names never start with a dot)."""
    return path.with_name(f".{path.name}.save-token")


def save_owner(path: Path) -> str | None:
    try:
        return owner_file(path).read_text() or None
    except OSError:
        return None


def claim_save(path: Path, token: str) -> None:
    """Written, and on disk, before the save starts: a crash after the save must find it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    target = owner_file(path)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(token)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
