"""Unit tests for API key material and log redaction (no database)."""

from __future__ import annotations

import hashlib
import logging

import pytest

from services.auth.keys import (
    DISPLAY_PREFIX_LENGTH,
    KEY_PREFIX,
    generate_api_key,
    hash_api_key,
    hashes_equal,
    key_matches,
    key_prefix,
    looks_like_api_key,
)
from services.auth.log_redaction import RedactApiKeysFilter, redact_key
from services.auth.tenants import IssuedKey
from services.db.ids import ApiKeyId


def test_generated_keys_are_prefixed_long_and_unique() -> None:
    keys = {generate_api_key() for _ in range(200)}
    assert len(keys) == 200
    for key in keys:
        assert key.startswith(KEY_PREFIX)
        assert len(key) >= len(KEY_PREFIX) + 43  # 32 random bytes, base64
        assert looks_like_api_key(key)


@pytest.mark.parametrize(
    "value", ["", "tml-", "tml-short", "sk-" + "a" * 43, "tml-" + "a" * 40 + "!", " " + "tml-" + "a" * 43]
)
def test_malformed_keys_are_rejected_by_shape(value: str) -> None:
    assert not looks_like_api_key(value)


def test_hash_is_sha256_hex_and_deterministic() -> None:
    key = generate_api_key()
    digest = hash_api_key(key)
    assert digest == hashlib.sha256(key.encode()).hexdigest()
    assert digest == hash_api_key(key)
    assert key not in digest
    assert len(digest) == 64


def test_pepper_changes_the_hash() -> None:
    key = generate_api_key()
    peppered = hash_api_key(key, b"server-secret")
    assert peppered != hash_api_key(key)
    assert peppered != hash_api_key(key, b"other-secret")
    assert key_matches(key, peppered, b"server-secret")
    assert not key_matches(key, peppered)


def test_key_matches_and_constant_time_compare() -> None:
    key = generate_api_key()
    assert key_matches(key, hash_api_key(key))
    assert not key_matches(generate_api_key(), hash_api_key(key))
    assert hashes_equal("ab", "ab")
    assert not hashes_equal("ab", "ac")


def test_prefix_is_short_and_not_the_key() -> None:
    key = generate_api_key()
    prefix = key_prefix(key)
    assert len(prefix) == DISPLAY_PREFIX_LENGTH
    assert key.startswith(prefix)
    assert prefix != key


def test_redact_key_keeps_only_the_display_prefix() -> None:
    key = generate_api_key()
    text = f"auth failed for Bearer {key} at /api/v1/x?key={key}"
    redacted = redact_key(text)
    assert key not in redacted
    assert redacted.count(key_prefix(key)) == 2
    assert redact_key("nothing secret here, tml- alone") == "nothing secret here, tml- alone"


def test_log_filter_redacts_arguments_and_exceptions() -> None:
    key = generate_api_key()
    logger = logging.getLogger("carpool.test.redaction")
    records: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(self.format(record))

    handler = Collect()
    handler.addFilter(RedactApiKeysFilter())
    logger.addHandler(handler)
    logger.propagate = False
    # Its own level: the root logger's is whatever an earlier test in this process left (a server started in
    # process sets it from CARPOOL_LOG_LEVEL), and a WARNING record must reach the handler whatever the order.
    logger.setLevel(logging.DEBUG)
    try:
        logger.warning("bad key %s", key)
        try:
            raise ValueError(f"rejected {key}")
        except ValueError:
            logger.exception("while authenticating")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert len(records) == 2
    assert all(key not in r for r in records)
    assert key_prefix(key) in records[0]
    assert "rejected" in records[1]


def test_issued_key_repr_hides_the_secret() -> None:
    key = generate_api_key()
    issued = IssuedKey(key=key, key_id=ApiKeyId(7), prefix=key_prefix(key))
    assert key not in repr(issued)
    assert key not in str(issued)
