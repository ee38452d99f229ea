"""Tenants' hub tokens at rest: Fernet (AES-128-CBC + HMAC-SHA256) under a key derived from the server key.

The server key is `CARPOOL_SECRET_KEY` (required in cluster mode, where every process must agree on it) or,
in `carpool serve`, a random key generated once under the data dir. Tokens are decrypted only inside the
push task, never returned by the API and never logged; a ciphertext made under another key is refused.
"""

from __future__ import annotations

import base64
import hashlib

from cryptography.fernet import Fernet, InvalidToken

MIN_SECRET_CHARS = 32
_CONTEXT = b"carpool hub credentials v1\x00"


class CredentialError(Exception):
    """A stored token that cannot be decrypted (the server key changed), or an unusable server key."""


class TokenCipher:
    """Encrypts and decrypts hub tokens with one server key."""

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_CHARS // 2:
            raise CredentialError(f"the server secret key must be at least {MIN_SECRET_CHARS} characters")
        # A dedicated derivation: the same server key may serve other purposes without key reuse.
        key = hashlib.sha256(_CONTEXT + secret).digest()
        self._fernet = Fernet(base64.urlsafe_b64encode(key))

    @classmethod
    def from_setting(cls, secret_key: str) -> TokenCipher:
        if len(secret_key) < MIN_SECRET_CHARS:
            raise CredentialError(f"CARPOOL_SECRET_KEY must be at least {MIN_SECRET_CHARS} characters, "
                                  f"got {len(secret_key)}")
        return cls(secret_key.encode())

    def encrypt(self, token: str) -> str:
        return self._fernet.encrypt(token.encode()).decode("ascii")

    def decrypt(self, ciphertext: str) -> str:
        try:
            return self._fernet.decrypt(ciphertext.encode("ascii")).decode()
        except (InvalidToken, ValueError) as exc:
            raise CredentialError("a stored hub token cannot be decrypted with this server's secret key; "
                                  "store it again with PUT /v1/hub_credentials/{hub}") from exc
