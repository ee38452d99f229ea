"""`S3CheckpointStore`: checkpoints as objects in an S3-compatible bucket, staged through a local cache.

Chosen by `CARPOOL_STORAGE_URL=s3://bucket/prefix`. Objects of one checkpoint live under
`<prefix>/tenants/<tenant>/runs/<run>/<kind>/<name>/` (components escaped by `safe_component`), and its URI
is `s3://<bucket>/<that key>`. Credentials come only from boto3's standard chain (environment, shared
config, web identity on Kubernetes); `endpoint_url` points at MinIO, Ceph, R2 or a test server.

A checkpoint becomes visible only when complete: its files are uploaded first (each hashed once; below the
multipart threshold one PutObject that carries that sha256 for S3 to check, from it parallel parts: see
`services.storage.s3_transfer`), then `carpool-manifest.json` with every file's size and sha256 is written
last. Without a manifest a checkpoint does not exist; a failed upload removes what it wrote, and
`sweep_incomplete` removes what a killed process left. Loads go through a `ReadThroughCache`: a cached
directory is used when it was filled from the current manifest, otherwise every file is downloaded and
checked against its sha256 (a mismatch is refused). `local_path(uri)` names the cache directory of a
checkpoint; workers recognise such paths (`uri_of_local_path`) and upload after writing / download before
reading (`services.storage.staging.StagedBackend`).
"""

from __future__ import annotations

import json
import logging
import shutil
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from services.storage.cache import ReadThroughCache
from services.storage.local import safe_component
from services.storage.protocol import CHECKPOINT_KINDS, CheckpointKind, StorageError
from services.storage.s3_transfer import client_config, get_file, put_file, sha256_file

log = logging.getLogger(__name__)

URI_SCHEME = "s3://"
MANIFEST = "carpool-manifest.json"
MANIFEST_FORMAT = "carpool-checkpoint-manifest"
_TAIL = 6  # tenants/<tenant>/runs/<run>/<kind>/<name>
_DEFAULT_THRESHOLD = 8 << 20  # s3transfer's own default, for a store built without a TransferConfig
_TRANSFER_THREADS = 4
MAX_PRESIGN_S = 7 * 24 * 3600  # S3's limit for SigV4 presigned URLs


@dataclass(frozen=True)
class S3Location:
    """Bucket and key prefix of `s3://bucket/prefix` (prefix without slashes at either end)."""

    bucket: str
    prefix: str

    @classmethod
    def parse(cls, url: str) -> S3Location:
        if not url.startswith(URI_SCHEME):
            raise StorageError(f"storage URL {url!r} must start with s3://")
        bucket, _, prefix = url[len(URI_SCHEME):].partition("/")
        if not bucket or "/" in bucket:
            raise StorageError(f"storage URL {url!r} names no bucket (s3://bucket/prefix)")
        return cls(bucket, prefix.strip("/"))


def _describe(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        error = response.get("Error", {})
        return f"{error.get('Code', '?')}: {error.get('Message', '') or exc}"
    return f"{type(exc).__name__}: {exc}"


class S3CheckpointStore:
    """`CheckpointStore` over an S3 bucket; `client` is a boto3 S3 client, `transfer` its TransferConfig."""

    remote = True

    def __init__(self, location: S3Location, client: Any, cache: ReadThroughCache, *,
                 transfer: Any = None) -> None:
        self.location = location
        self.cache = cache
        self._client = client
        self._transfer = transfer

    @property
    def _threshold(self) -> int:
        """Files of at least this size go multipart / in ranged GETs (the TransferConfig's own threshold)."""
        return int(getattr(self._transfer, "multipart_threshold", _DEFAULT_THRESHOLD))

    # -- addressing -------------------------------------------------------------------------------
    def uri_for(self, tenant_id: str, training_run_id: str, kind: CheckpointKind, name: str) -> str:
        if kind not in CHECKPOINT_KINDS:
            raise StorageError(f"unknown checkpoint kind {kind!r}")
        tail = ("tenants", safe_component(tenant_id), "runs", safe_component(training_run_id), kind,
                safe_component(name))
        key = "/".join(p for p in (self.location.prefix, *tail) if p)
        return f"{URI_SCHEME}{self.location.bucket}/{key}"

    def local_path(self, uri: str) -> Path:
        bucket, key = self._split(uri)
        return self.cache.entry_path(f"{bucket}/{key}")

    def uri_of_local_path(self, path: Path) -> str | None:
        """The URI whose `local_path` (on any node: cache roots may differ) is `path`; None if not one."""
        parts = Path(path).parts
        if len(parts) < _TAIL + 1 or parts[-_TAIL] != "tenants" or parts[-_TAIL + 2] != "runs":
            return None
        prefix_parts = tuple(p for p in self.location.prefix.split("/") if p)
        head = parts[: -_TAIL]
        if head[-len(prefix_parts) - 1:] != (self.location.bucket, *prefix_parts):
            return None
        uri = f"{URI_SCHEME}{self.location.bucket}/" + "/".join((*prefix_parts, *parts[-_TAIL:]))
        try:
            self._split(uri)
        except StorageError:
            return None
        return uri

    # -- contents ---------------------------------------------------------------------------------
    def exists(self, uri: str) -> bool:
        return self.manifest(uri) is not None

    def manifest(self, uri: str) -> dict[str, Any] | None:
        """The checkpoint's manifest; None when it does not exist (or was never completed)."""
        bucket, key = self._split(uri)
        try:
            body = self._client.get_object(Bucket=bucket, Key=f"{key}/{MANIFEST}")["Body"].read()
        except Exception as exc:
            if _is_missing(exc):
                return None
            raise StorageError(f"S3 read of {uri} failed ({_describe(exc)})") from exc
        try:
            manifest = json.loads(body)
            files = manifest["files"]
            assert isinstance(files, dict)
        except (ValueError, KeyError, AssertionError) as exc:
            raise StorageError(f"checkpoint {uri} has a malformed manifest") from exc
        return manifest

    def delete(self, uri: str) -> bool:
        bucket, key = self._split(uri)
        self.cache.discard(f"{bucket}/{key}")
        # The manifest goes first: from then on the checkpoint is invisible even if the rest fails.
        existed = self.manifest(uri) is not None
        self._delete_keys(bucket, [f"{key}/{MANIFEST}"])
        self._delete_keys(bucket, self._list_keys(bucket, f"{key}/"))
        return existed

    def size(self, uri: str) -> int:
        manifest = self.manifest(uri)
        return sum(int(f["size"]) for f in manifest["files"].values()) if manifest else 0

    def list_files(self, uri: str) -> list[str]:
        manifest = self.manifest(uri)
        return sorted(manifest["files"]) if manifest else []

    def copy_checkpoint(self, source_uri: str, target_uri: str) -> None:
        """Server-side copy of every file (no bytes through this process), the manifest last."""
        source_bucket, source_key = self._split(source_uri)
        bucket, key = self._split(target_uri)
        manifest = self.manifest(source_uri)
        if manifest is None:
            raise StorageError(f"checkpoint {source_uri} has no stored files")
        try:
            _in_parallel([lambda rel=rel: self._client.copy(
                {"Bucket": source_bucket, "Key": f"{source_key}/{rel}"}, bucket, f"{key}/{rel}",
                Config=self._transfer) for rel in manifest["files"]])
            self._client.put_object(Bucket=bucket, Key=f"{key}/{MANIFEST}",
                                    Body=json.dumps(manifest, sort_keys=True).encode())
        except Exception as exc:
            self._cleanup_failed(bucket, key)
            raise StorageError(f"S3 copy of {source_uri} failed ({_describe(exc)})") from exc

    # -- downloads --------------------------------------------------------------------------------
    def download_urls(self, uri: str, base_url: str, expires_at: datetime, *,
                      version: str | None = None) -> dict[str, str]:
        """Presigned GET URLs (`base_url` is unused: clients fetch straight from the bucket; `version` too:
        a presigned URL names the object key, see docs/security.md)."""
        bucket, key = self._split(uri)
        seconds = int(expires_at.timestamp() - time.time())
        expires_in = max(1, min(seconds, MAX_PRESIGN_S))
        try:
            return {rel: self._client.generate_presigned_url(
                "get_object", Params={"Bucket": bucket, "Key": f"{key}/{rel}"}, ExpiresIn=expires_in)
                for rel in self.list_files(uri)}
        except StorageError:
            raise
        except Exception as exc:
            raise StorageError(f"presigning {uri} failed ({_describe(exc)})") from exc

    # -- transfers (what workers call) ------------------------------------------------------------
    def staging_dir(self) -> Path:
        return self.cache.staging_dir()

    def upload(self, uri: str, directory: Path) -> int:
        """Upload a finished checkpoint directory, manifest last; then keep it as the cache entry."""
        bucket, key = self._split(uri)
        files = sorted(f for f in Path(directory).rglob("*") if f.is_file())
        described: dict[str, dict[str, object]] = {}

        def send(f: Path) -> None:  # hash and upload one file (files run in parallel)
            rel = f.relative_to(directory).as_posix()
            digest = sha256_file(f)
            described[rel] = {"size": f.stat().st_size, "sha256": digest}
            put_file(self._client, bucket, f"{key}/{rel}", f, digest, threshold=self._threshold,
                     transfer=self._transfer)

        try:
            old = self._list_keys(bucket, f"{key}/")
            # Overwrite: hide the old checkpoint first, so no reader pairs its manifest with new files.
            self._delete_keys(bucket, [f"{key}/{MANIFEST}"])
            _in_parallel([lambda f=f: send(f) for f in files])
            manifest = {"format": MANIFEST_FORMAT, "version": 1, "created_at": datetime.now(UTC).isoformat(),
                        "files": dict(sorted(described.items()))}
            self._client.put_object(Bucket=bucket, Key=f"{key}/{MANIFEST}",
                                    Body=json.dumps(manifest, sort_keys=True).encode())
        except Exception as exc:
            self._cleanup_failed(bucket, key)
            raise StorageError(f"S3 upload of {uri} failed ({_describe(exc)}); nothing was saved") from exc
        stale = set(old) - {f"{key}/{name}" for name in manifest["files"]} - {f"{key}/{MANIFEST}"}
        self._delete_keys(bucket, sorted(stale))
        self.cache.adopt(f"{bucket}/{key}", Path(directory), manifest)
        return sum(int(f["size"]) for f in manifest["files"].values())

    def fetch(self, uri: str) -> Path:
        """A local directory holding the complete, verified checkpoint (from the cache when current)."""
        bucket, key = self._split(uri)
        manifest = self.manifest(uri)
        if manifest is None:
            raise StorageError(f"checkpoint {uri} does not exist (or its upload never completed)")
        cached = self.cache.get(f"{bucket}/{key}", manifest)
        if cached is not None:
            return cached
        filled = self.cache.staging_dir()
        try:
            _in_parallel([lambda rel=rel, meta=meta: self._download_checked(uri, bucket, f"{key}/{rel}",
                                                                           filled / rel, meta)
                          for rel, meta in sorted(manifest["files"].items())])
            return self.cache.adopt(f"{bucket}/{key}", filled, manifest)
        except BaseException:
            shutil.rmtree(filled, ignore_errors=True)
            raise

    def sweep_incomplete(self, older_than_s: float = 3600.0, *, now: float | None = None) -> int:
        """Remove objects of checkpoints that never got a manifest (a killed upload) whose newest object is
        older than `older_than_s` at `now` (epoch seconds; default the current time); returns objects removed."""
        prefix = "/".join(p for p in (self.location.prefix, "tenants") if p) + "/"
        bucket = self.location.bucket
        cutoff = (time.time() if now is None else now) - older_than_s
        groups: dict[str, list[tuple[str, float]]] = {}
        for obj in self._list_objects(bucket, prefix):
            parts = obj["Key"].split("/")
            base = "/".join(parts[: len(prefix.split("/")) - 1 + _TAIL - 1])
            groups.setdefault(base, []).append((obj["Key"], obj["LastModified"].timestamp()))
        doomed = [k for base, objs in groups.items()
                  if f"{base}/{MANIFEST}" not in {k for k, _ in objs} and max(t for _, t in objs) < cutoff
                  for k, _ in objs]
        self._delete_keys(bucket, doomed)
        self._abort_multipart(bucket, prefix, cutoff)
        return len(doomed)

    # -- internals --------------------------------------------------------------------------------
    def _split(self, uri: str) -> tuple[str, str]:
        if not uri.startswith(URI_SCHEME):
            raise StorageError(f"not an S3 storage URI: {uri!r}")
        bucket, _, key = uri[len(URI_SCHEME):].partition("/")
        parts = key.split("/")
        if (not bucket or len(parts) < _TAIL or parts[-_TAIL] != "tenants" or parts[-_TAIL + 2] != "runs"
                or parts[-2] not in CHECKPOINT_KINDS or any(p in ("", ".", "..") for p in parts)):
            raise StorageError(f"malformed S3 storage URI: {uri!r}")
        return bucket, key

    def _download_checked(self, uri: str, bucket: str, key: str, dest: Path, meta: dict[str, Any]) -> None:
        dest.parent.mkdir(parents=True, exist_ok=True)
        try:
            size, digest = get_file(self._client, bucket, key, dest, int(meta["size"]), threshold=self._threshold,
                                    transfer=self._transfer)
        except Exception as exc:
            raise StorageError(f"S3 download of {uri} failed at {key} ({_describe(exc)})") from exc
        if size != int(meta["size"]) or digest != meta["sha256"]:
            raise StorageError(f"checkpoint {uri} is corrupted: {dest.name} does not match the sha256 and "
                               "size in its manifest; refusing to load it")

    def _cleanup_failed(self, bucket: str, key: str) -> None:
        try:
            self._delete_keys(bucket, self._list_keys(bucket, f"{key}/"))
        except Exception:  # noqa: BLE001 - S3 is likely down; sweep_incomplete removes the rest later
            log.warning("could not remove the partial upload under s3://%s/%s", bucket, key)

    def _list_objects(self, bucket: str, prefix: str) -> list[dict[str, Any]]:
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
            return [obj for page in pages for obj in page.get("Contents", [])]
        except Exception as exc:
            raise StorageError(f"S3 listing of s3://{bucket}/{prefix} failed ({_describe(exc)})") from exc

    def _list_keys(self, bucket: str, prefix: str) -> list[str]:
        return [obj["Key"] for obj in self._list_objects(bucket, prefix)]

    def _delete_keys(self, bucket: str, keys: list[str]) -> None:
        try:
            for start in range(0, len(keys), 1000):  # DeleteObjects takes at most 1000 keys
                batch = [{"Key": k} for k in keys[start:start + 1000]]
                self._client.delete_objects(Bucket=bucket, Delete={"Objects": batch, "Quiet": True})
        except Exception as exc:
            raise StorageError(f"S3 delete under s3://{bucket} failed ({_describe(exc)})") from exc

    def _abort_multipart(self, bucket: str, prefix: str, cutoff: float) -> None:
        uploads = self._client.list_multipart_uploads(Bucket=bucket, Prefix=prefix).get("Uploads", [])
        for upload in uploads:
            if upload["Initiated"].timestamp() < cutoff:
                self._client.abort_multipart_upload(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])


def build_s3_store(url: str, *, cache_dir: Path, cache_max_bytes: int, endpoint_url: str | None = None,
                   multipart_threshold: int = 64 << 20, timeout_s: float = 30.0,
                   max_attempts: int = 3) -> S3CheckpointStore:
    """An `S3CheckpointStore` for `s3://bucket/prefix`, with bounded timeouts and retries on every call."""
    import boto3
    from boto3.s3.transfer import TransferConfig

    location = S3Location.parse(url)
    # No credentials here on purpose: boto3's chain (env, shared config, web identity) supplies them.
    client = boto3.session.Session().client("s3", endpoint_url=endpoint_url,
                                            config=client_config(timeout_s, max_attempts))
    transfer = TransferConfig(multipart_threshold=multipart_threshold,
                              multipart_chunksize=max(multipart_threshold, 5 << 20))
    return S3CheckpointStore(location, client, ReadThroughCache(cache_dir, cache_max_bytes), transfer=transfer)


def _in_parallel(calls: list[Callable[[], object]]) -> None:
    """Run `calls` on a few threads; the first failure is raised once all have ended."""
    with ThreadPoolExecutor(max_workers=max(1, min(_TRANSFER_THREADS, len(calls)))) as pool:
        for future in [pool.submit(call) for call in calls]:
            future.result()


def _is_missing(exc: Exception) -> bool:
    response = getattr(exc, "response", None)
    code = response.get("Error", {}).get("Code") if isinstance(response, dict) else None
    return code in ("NoSuchKey", "404", "NotFound")
