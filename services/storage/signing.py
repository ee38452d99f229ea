"""Signed, expiring tokens for download URLs: HMAC-SHA256 over a path and an expiry, with a server secret.

A token is `<payload>.<mac>`, both base64url without padding; the payload is compact JSON
`{"p": path, "e": expiry_unix_seconds, "v": version}`. Anyone holding a token can download the one file it
names until it expires, and nobody without the secret can mint or alter one. `v` (optional) names the
version of what was signed — the checkpoint row — so that the reader can refuse a token once the path
holds something else (deleted and saved again under the same name). Lifetimes are capped at
`MAX_TOKEN_TTL_S`. The secret is generated on first start
and persisted under the data dir (mode 0600), so URLs stay valid across restarts.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import os
import secrets
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

from services.storage.protocol import InvalidToken

SECRET_BYTES = 32
MIN_SECRET_BYTES = 16
MAX_TOKEN_TTL_S = 7 * 24 * 3600
"""Longest lifetime of a download token (a leaked link stops working within a week at most)."""


def _b64encode(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def _b64decode(text: str) -> bytes:
    padded = text + "=" * (-len(text) % 4)
    return base64.urlsafe_b64decode(padded.encode("ascii"))


class UrlSigner:
    """Mints and checks download tokens; `clock` returns Unix seconds (injectable for tests)."""

    def __init__(self, secret: bytes, *, clock: Callable[[], float] = time.time) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"signing secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}")
        self._secret = secret
        self._clock = clock

    def sign(self, path: str, expires_at: datetime, *, version: str | None = None) -> str:
        """A token for `path` (optionally bound to `version`), valid until `expires_at` (an aware datetime,
        at most `MAX_TOKEN_TTL_S` away)."""
        if expires_at.tzinfo is None:
            raise ValueError("expires_at must be timezone-aware")
        if expires_at.timestamp() - self._clock() > MAX_TOKEN_TTL_S:
            raise ValueError(f"download tokens live at most {MAX_TOKEN_TTL_S} s")
        claims: dict[str, object] = {"p": path, "e": int(expires_at.timestamp())}
        if version is not None:
            claims["v"] = version
        payload = json.dumps(claims, separators=(",", ":"))
        encoded = _b64encode(payload.encode("utf-8"))
        return f"{encoded}.{self._mac(encoded)}"

    def verify(self, token: str) -> str:
        """The path a valid, unexpired token names; raises `InvalidToken` otherwise."""
        encoded, sep, mac = token.partition(".")
        if not sep or not encoded or not mac or not token.isascii():  # base64url is ASCII; the MAC needs it
            raise InvalidToken("malformed download token")
        # Constant-time comparison: a timing oracle must not reveal how much of a forged MAC matched.
        if not hmac.compare_digest(mac.encode("ascii", "replace"), self._mac(encoded).encode("ascii")):
            raise InvalidToken("download token signature does not match")
        path, expires = self._payload(encoded)
        if expires <= self._clock():
            raise InvalidToken("download token has expired")
        return path

    def _mac(self, encoded_payload: str) -> str:
        digest = hmac.new(self._secret, encoded_payload.encode("ascii"), hashlib.sha256).digest()
        return _b64encode(digest)

    @staticmethod
    def _payload(encoded: str) -> tuple[str, float]:
        try:
            data = json.loads(_b64decode(encoded))
            path, expires = data["p"], data["e"]
        except (binascii.Error, UnicodeDecodeError, ValueError, KeyError, TypeError) as exc:
            raise InvalidToken("malformed download token payload") from exc
        if not isinstance(path, str) or not isinstance(expires, int | float):
            raise InvalidToken("malformed download token payload")
        return path, float(expires)


def token_version(token: str) -> str | None:
    """The `version` a token was signed for (None: unbound). Reads the payload only: call it on a token
    that `UrlSigner.verify` (or the store's `open_signed`) has accepted."""
    encoded = token.partition(".")[0]
    try:
        version = json.loads(_b64decode(encoded)).get("v")
    except (binascii.Error, UnicodeDecodeError, ValueError, AttributeError) as exc:
        raise InvalidToken("malformed download token payload") from exc
    return version if isinstance(version, str) else None


def load_or_create_secret(path: Path) -> bytes:
    """The secret stored at `path`, created (random, mode 0600) if it does not exist yet.

    Creation uses O_EXCL, so two processes starting at once agree on one secret: the loser reads the
    winner's file.
    """
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            pass
        else:
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_hex(SECRET_BYTES) + "\n")
                f.flush()
                os.fsync(f.fileno())
    return _read_secret(path)


def _read_secret(path: Path) -> bytes:
    text = path.read_text().strip()
    for _ in range(50):  # another process may have created the file and not written it yet
        if text:
            break
        time.sleep(0.01)
        text = path.read_text().strip()
    try:
        secret = bytes.fromhex(text)
    except ValueError as exc:
        raise ValueError(f"signing secret {path} is not hex; delete it to generate a new one") from exc
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(f"signing secret {path} is too short; delete it to generate a new one")
    return secret
