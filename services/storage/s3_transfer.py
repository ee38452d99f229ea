"""Moving one checkpoint file to or from S3 with as few passes over its bytes as possible.

What a save used to cost, measured against moto (bench/storage.py, docs/storage.md): Carpool hashed each
file for the manifest, then botocore read it again to sha256-sign the payload (over plain HTTP) and once
more for its default CRC32, and only then sent it. Now a file is hashed once: the digest goes into the
manifest *and* into the PutObject as `ChecksumSHA256`, which S3 verifies against the bytes it stores (the
bucket refuses a body that does not match the manifest), so botocore needs neither its CRC32 nor a signed
payload (`payload_signing_enabled=False`, what it does by itself over HTTPS when a checksum is present).
Files of at least the multipart threshold still go through s3transfer in parallel parts (each part
checked by botocore's CRC32), as real S3 needs for large files.

A load is one pass too: a file below the threshold is a single streamed GET, hashed while it is written
(no reading the file back); a larger one is fetched in parallel ranged GETs by s3transfer and hashed after.
"""

from __future__ import annotations

import base64
import hashlib
from pathlib import Path
from typing import Any

_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    """The hex sha256 of a file, read in 1 MiB blocks (hashlib releases the GIL for each block)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def client_config(timeout_s: float, max_attempts: int) -> Any:
    """The botocore `Config` of the store's client: bounded timeouts and retries on every call; payloads
    not sha256-signed (integrity comes from the checksums each upload carries, see the module)."""
    from botocore.config import Config

    return Config(connect_timeout=timeout_s, read_timeout=timeout_s,
                  retries={"max_attempts": max_attempts, "mode": "standard"},
                  s3={"payload_signing_enabled": False}, max_pool_connections=16)


def put_file(client: Any, bucket: str, key: str, path: Path, sha256_hex: str, *, threshold: int,
             transfer: Any) -> None:
    """Upload `path` (whose sha256 is `sha256_hex`) to `bucket/key`; one PutObject below `threshold`."""
    size = path.stat().st_size
    if size >= threshold:
        client.upload_file(str(path), bucket, key, Config=transfer)
        return
    checksum = base64.b64encode(bytes.fromhex(sha256_hex)).decode()
    with open(path, "rb") as body:
        client.put_object(Bucket=bucket, Key=key, Body=body, ChecksumAlgorithm="SHA256",
                          ChecksumSHA256=checksum)


def get_file(client: Any, bucket: str, key: str, dest: Path, size: int, *, threshold: int,
             transfer: Any, attempts: int = 3) -> tuple[int, str]:
    """Download `bucket/key` into `dest`; returns the size and hex sha256 of what was written."""
    if size >= threshold:
        client.download_file(bucket, key, str(dest), Config=transfer)
        return dest.stat().st_size, sha256_file(dest)
    from botocore.exceptions import IncompleteReadError, ReadTimeoutError, ResponseStreamingError

    # botocore retries a failed request, not a body that breaks off while streaming: that is retried here
    # (as s3transfer does for its own downloads), from the start, since the hash covers the whole file.
    attempt = 1
    while True:
        try:
            return _stream_into(client.get_object(Bucket=bucket, Key=key)["Body"], dest)
        except (IncompleteReadError, ReadTimeoutError, ResponseStreamingError):
            if attempt >= attempts:
                raise
            attempt += 1


def _stream_into(body: Any, dest: Path) -> tuple[int, str]:
    digest = hashlib.sha256()
    written = 0
    try:
        with open(dest, "wb") as f:
            for block in body.iter_chunks(_CHUNK):
                digest.update(block)
                f.write(block)
                written += len(block)
    finally:
        body.close()
    return written, digest.hexdigest()
