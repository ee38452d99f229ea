"""API key material: generation, hashing, display prefixes and format checks. Pure, no database.

Keys carry 256 bits of randomness, so a fast hash (SHA-256) is enough to make a stolen hash useless:
there is nothing to brute-force, unlike passwords. An optional server-side pepper turns the hash into an
HMAC, so that a leaked database alone does not even let one test candidate keys.
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets

KEY_PREFIX = "tml-"
KEY_RANDOM_BYTES = 32
DISPLAY_PREFIX_LENGTH = 12
"""`tml-` plus 8 random characters: enough to tell keys apart in a listing, far too little to guess one."""

# urlsafe base64 of 32 bytes is 43 characters; accept a range so a later length change stays compatible.
KEY_PATTERN = re.compile(r"tml-[A-Za-z0-9_-]{32,128}")


def generate_api_key() -> str:
    """A new random key: `tml-` + 32 random bytes, urlsafe base64 without padding (47 characters)."""
    return KEY_PREFIX + secrets.token_urlsafe(KEY_RANDOM_BYTES)


def looks_like_api_key(value: str) -> bool:
    """Whether `value` has the shape of one of our keys (cheap rejection before any hashing or lookup)."""
    return KEY_PATTERN.fullmatch(value) is not None


def hash_api_key(key: str, pepper: bytes | None = None) -> str:
    """The hex digest stored for `key`: SHA-256, or HMAC-SHA-256 with the server's `pepper`."""
    data = key.encode("utf-8")
    if pepper:
        return hmac.new(pepper, data, hashlib.sha256).hexdigest()
    return hashlib.sha256(data).hexdigest()


def key_prefix(key: str) -> str:
    """The non-secret head of a key, stored and shown so tenants can tell their keys apart and revoke one."""
    return key[:DISPLAY_PREFIX_LENGTH]


def hashes_equal(a: str, b: str) -> bool:
    """Constant-time comparison of two key hashes (never compare secrets with ==)."""
    return hmac.compare_digest(a.encode("utf-8"), b.encode("utf-8"))


def key_matches(key: str, stored_hash: str, pepper: bytes | None = None) -> bool:
    """Whether `key` hashes to `stored_hash`, compared in constant time."""
    return hashes_equal(hash_api_key(key, pepper), stored_hash)
