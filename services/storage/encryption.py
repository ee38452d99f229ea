"""age encryption of exported checkpoint files (`save_weights_external(age_encryption_recipients=...)`).

With recipients, every file of an `external_weights/` export is encrypted to all of them (the `age`
format, filippo.io/age, through the `pyrage` package) and stored as `<file>.age`; the plaintext is
removed before the checkpoint is recorded, so the server only ever serves ciphertext for it. Recipients
are native X25519 keys (`age1...`) or SSH public keys (`ssh-ed25519 ...`, `ssh-rsa ...`), at most ten —
what `tinker_cookbook.weights.download` generates and decrypts with `pyrage`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from services.storage.protocol import StorageError

AGE_SUFFIX = ".age"
MAX_RECIPIENTS = 10
_PARTIAL_SUFFIX = ".age-partial"


class EncryptionError(StorageError):
    """Recipients that cannot be used, or encryption that is not available on this server."""


def _pyrage() -> Any:
    try:
        import pyrage
    except ImportError as exc:  # pragma: no cover - pyrage is a dependency of the service
        raise EncryptionError("age encryption is not available on this server (the pyrage package is not "
                              "installed); omit age_encryption_recipients") from exc
    return pyrage


def _recipient(text: str) -> Any:
    pyrage = _pyrage()
    if text.startswith("age1"):
        return pyrage.x25519.Recipient.from_str(text)
    if text.startswith("ssh-"):
        return pyrage.ssh.Recipient.from_str(text)
    raise ValueError("not an age X25519 key (age1...) or an SSH public key (ssh-...)")


def check_recipients(recipients: Sequence[str]) -> tuple[str, ...]:
    """The recipients, stripped, after checking each parses; raises `EncryptionError` naming the bad one."""
    if not recipients:
        raise EncryptionError("age_encryption_recipients: give at least one recipient or omit the field")
    if len(recipients) > MAX_RECIPIENTS:
        raise EncryptionError(f"age_encryption_recipients: at most {MAX_RECIPIENTS} recipients, "
                              f"got {len(recipients)}")
    checked = []
    for i, raw in enumerate(recipients):
        text = str(raw).strip()
        try:
            _recipient(text)
        except EncryptionError:
            raise
        except Exception as exc:  # pyrage raises its own RecipientError (and ValueError above)
            shown = text if len(text) <= 80 else text[:77] + "..."
            raise EncryptionError(f"age_encryption_recipients[{i}]: {shown!r} is not a valid age recipient: "
                                  f"{exc}") from exc
        checked.append(text)
    return tuple(checked)


def encrypt_directory(path: Path, recipients: Sequence[str]) -> int:
    """Encrypt every file under `path` to `recipients` as `<file>.age` and delete the plaintext.

    Returns the total size of the encrypted files. All files are encrypted before any plaintext is
    removed; on failure the partial outputs are removed and the error is raised (the caller discards
    the export).
    """
    pyrage = _pyrage()
    parsed = [_recipient(r) for r in check_recipients(recipients)]
    plain = sorted(f for f in Path(path).rglob("*") if f.is_file() and not f.name.endswith(AGE_SUFFIX))
    partials: list[tuple[Path, Path]] = []
    try:
        for file in plain:
            partial = file.with_name(file.name + _PARTIAL_SUFFIX)
            partials.append((file, partial))
            pyrage.encrypt_file(str(file), str(partial), parsed)
    except BaseException:
        for _, partial in partials:
            partial.unlink(missing_ok=True)
        raise
    total = 0
    for file, partial in partials:
        final = file.with_name(file.name + AGE_SUFFIX)
        os.replace(partial, final)
        file.unlink()
        total += final.stat().st_size
    return total
