"""Keeping API keys out of logs: a text redactor and a `logging.Filter` that applies it to every record.

Install the filter on the root handler(s) at startup; it rewrites the formatted message, so keys passed
as `%s` arguments, embedded in exception text or in URLs are all caught.
"""

from __future__ import annotations

import logging
import re

from services.auth.keys import KEY_PREFIX, key_prefix

# Looser than keys.KEY_PATTERN on purpose: a truncated or slightly malformed key is still a secret.
REDACTED_SUFFIX = "…[redacted]"
# The lookahead leaves an already redacted key alone, so applying the filter twice (logger and handler,
# as `install_key_redaction` does) does not append a second marker.
_KEY_IN_TEXT = re.compile(re.escape(KEY_PREFIX) + r"[A-Za-z0-9_-]{8,}(?!" + re.escape(REDACTED_SUFFIX) + ")")


def _redact_match(match: re.Match[str]) -> str:
    # Keep the display prefix: it is not secret and tells an operator which key was involved.
    return key_prefix(match.group(0)) + REDACTED_SUFFIX


def redact_key(text: str) -> str:
    """`text` with every API key replaced by its display prefix plus a redaction marker."""
    return _KEY_IN_TEXT.sub(_redact_match, text)


class RedactApiKeysFilter(logging.Filter):
    """A logging filter that redacts API keys from the record's message (and never drops a record)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        redacted = redact_key(message)
        if redacted != message:
            record.msg = redacted
            record.args = None
        if record.exc_info and not record.exc_text:
            record.exc_text = logging.Formatter().formatException(record.exc_info)
        if record.exc_text:
            record.exc_text = redact_key(record.exc_text)
        return True


def install_key_redaction() -> None:
    """Redact API keys from every log record. Handler filters see records of all loggers (a filter on a
    logger only sees that logger's own records), so the filter goes on the root logger and its handlers."""
    root = logging.getLogger()
    for target in (root, *root.handlers):
        if not any(isinstance(f, RedactApiKeysFilter) for f in target.filters):
            target.addFilter(RedactApiKeysFilter())
