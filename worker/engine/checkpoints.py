"""Adapter checkpoints on disk: PEFT-format export/import plus Carpool's state for resuming training.

A checkpoint is one directory:
- `adapter_config.json` + `adapter_model.safetensors`: a standard PEFT LoRA adapter (keys
  `base_model.model.<layer>.lora_A.weight` / `.lora_B.weight`), loadable by `peft.PeftModel.from_pretrained`.
- with the optimizer only: `carpool_state.safetensors` (AdamW moments `exp_avg.<param>` /
  `exp_avg_sq.<param>` and pending gradients `grad.<param>`) and `carpool_state.json` (format version,
  the spec with its seed and alpha, the optimizer step count and pending gradient passes).

Saving is split in two so the engine holds its lock only while copying tensors (`snapshot`), not while
writing files (`write_checkpoint`). Directories are written atomically: a temp directory beside the
target, renamed into place, and on disk (files, directory and the rename fsynced) before `write_checkpoint`
returns, except in a scratch directory whose copy is made durable elsewhere (an S3 upload; see
`services.storage.durability`). Loading reads everything on the host (`read_checkpoint`) and then checks it
against the base model's layers before building an `AdapterState` (`build_adapter`).
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import uuid
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from torch import nn

from services.domain.training import AdapterId, LoraSpec
from services.storage.durability import fsync_dir, fsync_file, is_scratch
from worker.engine.adapters import AdapterState, OptimizerState
from worker.engine.lora import (
    ALL_TARGETS,
    ATTN_TARGETS,
    MLP_TARGETS,
    UNEMBED_TARGETS,
    MultiLoraLinear,
    target_suffixes,
)

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
STATE_TENSORS = "carpool_state.safetensors"
STATE_META = "carpool_state.json"
# Files a checkpoint directory may hold (peft's own save_pretrained adds a README); an existing
# directory with anything else in it is not ours to replace.
_REPLACEABLE = {ADAPTER_CONFIG, ADAPTER_WEIGHTS, STATE_TENSORS, STATE_META, "README.md"}
_PEFT_PREFIX = "base_model.model."
_FACTORS = ("lora_A", "lora_B")
_SPEC_FIELDS = ("rank", "alpha", "seed", "train_attn", "train_mlp", "train_unembed")
# peft options that change what the factors mean; Carpool computes plain LoRA only.
_UNSUPPORTED_PEFT_OPTIONS = ("use_dora", "fan_in_fan_out", "rank_pattern", "alpha_pattern", "modules_to_save",
                             "lora_bias", "layer_replication")


class CheckpointError(ValueError):
    """A checkpoint that is missing, malformed or does not fit this base model (names the path/field)."""


@dataclass
class AdapterSnapshot:
    """Host copies of everything a checkpoint holds, independent of the live adapter."""

    spec: LoraSpec
    """With the adapter's actual seed (drawn at creation when the tenant gave none); None if unknown."""
    params: dict[str, torch.Tensor]
    """`<layer>.lora_A` / `<layer>.lora_B` → factor, as in `AdapterState.params`."""
    base_model: str | None = None
    optimizer: OptimizerState | None = None
    """None: weights only (a fresh optimizer on load)."""
    grads: dict[str, torch.Tensor] = field(default_factory=dict)
    pending_grad_passes: int = 0
    source: Path | None = None
    """The directory it was read from (named in errors)."""


# -- save -----------------------------------------------------------------------------------------
def snapshot(state: AdapterState, *, base_model: str, with_optimizer: bool) -> AdapterSnapshot:
    """Copy the adapter to host memory (always a copy: on CPU the live tensors keep training)."""
    snap = AdapterSnapshot(spec=replace(state.spec, seed=state.seed), params=_host(state.params),
                           base_model=base_model)
    if with_optimizer:
        opt = state.optimizer
        snap.optimizer = OptimizerState(opt.step, _host(opt.exp_avg), _host(opt.exp_avg_sq))
        snap.grads = _host(state.grads())
        snap.pending_grad_passes = state.pending_grad_passes
    return snap


def write_checkpoint(snap: AdapterSnapshot, path: Path) -> int:
    """Write `snap` as a checkpoint directory at `path` (replacing an older checkpoint); return bytes."""
    weights = {f"{_PEFT_PREFIX}{k}.weight": t for k, t in snap.params.items()}
    files = {
        ADAPTER_CONFIG: _json_bytes(peft_config(snap.spec, _suffixes(snap.params), snap.base_model)),
        ADAPTER_WEIGHTS: save_safetensors(weights, metadata={"format": "pt"}),
    }
    if snap.optimizer is not None:
        files[STATE_TENSORS] = save_safetensors(_state_tensors(snap), metadata={"format": "pt"})
        files[STATE_META] = _json_bytes(_state_meta(snap))
    return _write_dir_atomically(Path(path), files)


def save_checkpoint(state: AdapterState, path: Path, *, base_model: str, with_optimizer: bool) -> int:
    return write_checkpoint(snapshot(state, base_model=base_model, with_optimizer=with_optimizer), path)


def peft_config(spec: LoraSpec, target_modules: list[str], base_model: str | None) -> dict[str, object]:
    """peft `LoraConfig` fields; those peft has had for many releases, so older peft loads it too."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "revision": None, "inference_mode": True, "r": spec.rank, "lora_alpha": spec.alpha,
        "target_modules": target_modules, "lora_dropout": 0.0, "fan_in_fan_out": False, "bias": "none",
        "use_rslora": False, "use_dora": False, "modules_to_save": None, "init_lora_weights": True,
        "layers_to_transform": None, "layers_pattern": None, "rank_pattern": {}, "alpha_pattern": {},
    }


def _host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: t.detach().to("cpu", copy=True).contiguous() for k, t in tensors.items()}


def _suffixes(params: dict[str, torch.Tensor]) -> list[str]:
    return sorted({k.rsplit(".", 1)[0].rsplit(".", 1)[-1] for k in params})


def _state_tensors(snap: AdapterSnapshot) -> dict[str, torch.Tensor]:
    assert snap.optimizer is not None
    out = {f"exp_avg.{k}": t for k, t in snap.optimizer.exp_avg.items()}
    out.update({f"exp_avg_sq.{k}": t for k, t in snap.optimizer.exp_avg_sq.items()})
    out.update({f"grad.{k}": t for k, t in snap.grads.items()})
    return out


def _state_meta(snap: AdapterSnapshot) -> dict[str, object]:
    assert snap.optimizer is not None
    return {
        "format": "carpool-adapter-state", "format_version": FORMAT_VERSION, "base_model": snap.base_model,
        "spec": asdict(snap.spec), "optimizer_step": snap.optimizer.step,
        "pending_grad_passes": snap.pending_grad_passes,
    }


def _json_bytes(obj: dict[str, object]) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _write_dir_atomically(path: Path, files: dict[str, bytes]) -> int:
    """Files into a temp directory, swapped in by rename; durable on disk before returning (the caller
    acknowledges the checkpoint) unless the parent is scratch space whose copy is made durable elsewhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    durable = not is_scratch(path.parent)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        os.chmod(tmp, 0o755)  # mkdtemp makes it private; readers (samplers, exports) need access
        total = sum(_write_file(tmp / name, data) for name, data in files.items())
        if durable:
            # Before the rename, so a crash never leaves a complete-looking directory of partial files;
            # the directory too, or a power loss can leave it without its files' names.
            for name in files:
                fsync_file(tmp / name)
            fsync_dir(tmp)
        _swap_in(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if durable:
        fsync_dir(path.parent)  # the rename that put the checkpoint in place
    return total


def _write_file(path: Path, data: bytes) -> int:
    with open(path, "wb") as f:
        f.write(data)
    return len(data)


def _swap_in(tmp: Path, path: Path) -> None:
    if not path.exists():
        os.rename(tmp, path)
        return
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} exists and is not a directory")
    unexpected = sorted(p.name for p in path.iterdir() if p.name not in _REPLACEABLE)
    if unexpected:
        raise CheckpointError(f"refusing to replace {path}: it holds files that are not a checkpoint's: "
                              f"{unexpected}")
    # A directory cannot be renamed over a non-empty one: move the old one aside, then drop it.
    old = path.with_name(f".{path.name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(path, old)
    try:
        os.rename(tmp, path)
    except BaseException:
        os.rename(old, path)
        raise
    shutil.rmtree(old, ignore_errors=True)


# -- load -----------------------------------------------------------------------------------------
def read_checkpoint(path: Path, *, with_optimizer: bool, base_model: str | None = None) -> AdapterSnapshot:
    """Read a checkpoint (ours, or any PEFT LoRA adapter for weights only) into host memory."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    config = _read_json(path / ADAPTER_CONFIG)
    params = _factors_from_peft(_read_tensors(path / ADAPTER_WEIGHTS), path / ADAPTER_WEIGHTS)
    meta_path = path / STATE_META
    meta = _read_json(meta_path) if with_optimizer or meta_path.exists() else None
    # Our own state file has the full spec (seed included); a plain PEFT adapter has only its config.
    if meta is not None:
        spec = _spec_from_meta(meta, meta_path)
    else:
        spec = spec_from_peft_config(config, _suffixes(params), path / ADAPTER_CONFIG)
    _check_rank(params, spec.rank, path / ADAPTER_WEIGHTS)
    saved_on = _saved_on(config, base_model, path)
    snap = AdapterSnapshot(spec=spec, params=params, source=path, base_model=saved_on)
    if meta is not None and with_optimizer:
        _read_training_state(snap, meta, path / STATE_TENSORS)
    return snap


def _saved_on(config: dict[str, object], base_model: str | None, path: Path) -> str | None:
    saved_on = config.get("base_model_name_or_path")
    if not isinstance(saved_on, str):
        return None
    if base_model is not None and saved_on != base_model:
        # Names differ between local paths and hub ids of one model: `build_adapter`'s shape checks
        # decide whether it fits.
        log.warning("checkpoint %s was saved on base model %r, loading on %r", path, saved_on, base_model)
    return saved_on


def build_adapter(snap: AdapterSnapshot, adapter_id: AdapterId, layers: dict[str, MultiLoraLinear],
                  device: torch.device) -> AdapterState:
    """An adapter on `device` from `snap`, after checking every factor against the base model's layers."""
    for key, t in snap.params.items():
        _check_factor(key, t, layers, snap.spec, snap.source)
    # Factors train in fp32 whatever the base dtype (as `new_adapter` makes them); fp32 stays bit-exact.
    params = {k: nn.Parameter(t.to(device=device, dtype=torch.float32), requires_grad=True)
              for k, t in sorted(snap.params.items())}
    state = AdapterState(adapter_id=adapter_id, spec=snap.spec, seed=snap.spec.seed or 0, params=params)
    if snap.optimizer is None:
        return state
    state.optimizer = OptimizerState(
        step=snap.optimizer.step,
        exp_avg=_matching(snap.optimizer.exp_avg, params, f"{snap.source}: exp_avg"),
        exp_avg_sq=_matching(snap.optimizer.exp_avg_sq, params, f"{snap.source}: exp_avg_sq"),
    )
    for key, grad in _matching(snap.grads, params, f"{snap.source}: grad").items():
        params[key].grad = grad
    state.pending_grad_passes = snap.pending_grad_passes
    return state


def load_checkpoint(path: Path, adapter_id: AdapterId, layers: dict[str, MultiLoraLinear],
                    device: torch.device, *, with_optimizer: bool,
                    base_model: str | None = None) -> AdapterState:
    snap = read_checkpoint(path, with_optimizer=with_optimizer, base_model=base_model)
    return build_adapter(snap, adapter_id, layers, device)


def spec_from_peft_config(config: dict[str, object], suffixes: list[str], where: Path) -> LoraSpec:
    """Best-effort spec for a PEFT adapter: rank and alpha from its config, targets from its factors."""
    if config.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"{where}: peft_type {config.get('peft_type')!r} is not supported (only LORA)")
    for name in _UNSUPPORTED_PEFT_OPTIONS:
        if config.get(name):  # every one of them is off when falsy (False, None, {} or [])
            raise CheckpointError(f"{where}: {name}={config.get(name)!r} is not supported")
    rank = _int_field(config, "r", where)
    alpha = config.get("lora_alpha", 8)  # peft's default when absent
    if not isinstance(alpha, int | float) or isinstance(alpha, bool):
        raise CheckpointError(f"{where}: field 'lora_alpha' must be a number, got {alpha!r}")
    alpha = float(alpha)
    if config.get("use_rslora"):
        alpha *= math.sqrt(rank)  # rsLoRA scales by alpha/sqrt(r); ours is alpha/r
    return LoraSpec(rank=rank, alpha=alpha, seed=None,
                    train_attn=any(s in ATTN_TARGETS for s in suffixes),
                    train_mlp=any(s in MLP_TARGETS for s in suffixes),
                    train_unembed=any(s in UNEMBED_TARGETS for s in suffixes))


def _read_json(path: Path) -> dict[str, object]:
    try:
        obj = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"checkpoint file {path} is unreadable: {exc}") from exc
    if not isinstance(obj, dict):
        raise CheckpointError(f"checkpoint file {path} must hold a JSON object")
    return obj


def _read_tensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return load_safetensors(path.read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint file {path} is missing") from None
    except (OSError, SafetensorError) as exc:
        raise CheckpointError(f"checkpoint file {path} is unreadable: {exc}") from exc


def _factors_from_peft(tensors: dict[str, torch.Tensor], where: Path) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        name = key.removeprefix(_PEFT_PREFIX).removesuffix(".weight")
        layer, _, factor = name.rpartition(".")
        if not key.startswith(_PEFT_PREFIX) or not key.endswith(".weight") or factor not in _FACTORS:
            raise CheckpointError(f"{where}: tensor {key!r} is not a LoRA factor (only lora_A/lora_B "
                                  "weights are supported)")
        if layer.rsplit(".", 1)[-1] not in ALL_TARGETS:
            raise CheckpointError(f"{where}: tensor {key!r} targets a module Carpool cannot train")
        params[name] = t
    if not params:
        raise CheckpointError(f"{where}: no LoRA factors")
    for name in params:
        layer, _, factor = name.rpartition(".")
        partner = f"{layer}.{'lora_B' if factor == 'lora_A' else 'lora_A'}"
        if partner not in params:
            raise CheckpointError(f"{where}: {name} has no matching {partner}")
    return params


def _check_rank(params: dict[str, torch.Tensor], rank: int, where: Path) -> None:
    for key, t in params.items():
        if t.dim() != 2 or (t.shape[0] if key.endswith("lora_A") else t.shape[1]) != rank:
            raise CheckpointError(f"{where}: {key} has shape {tuple(t.shape)}, not rank r={rank}")


def _spec_from_meta(meta: dict[str, object], where: Path) -> LoraSpec:
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{where}: format_version {version!r} is not supported (<= {FORMAT_VERSION})")
    spec = meta.get("spec")
    if not isinstance(spec, dict) or set(spec) != set(_SPEC_FIELDS):
        raise CheckpointError(f"{where}: field 'spec' must hold exactly {list(_SPEC_FIELDS)}")
    try:
        return LoraSpec(**spec)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{where}: field 'spec' is invalid: {exc}") from exc


def _read_training_state(snap: AdapterSnapshot, meta: dict[str, object], path: Path) -> None:
    tensors = _read_tensors(path)
    groups: dict[str, dict[str, torch.Tensor]] = {"exp_avg": {}, "exp_avg_sq": {}, "grad": {}}
    for key, t in tensors.items():
        group, _, name = key.partition(".")
        if group not in groups or name not in snap.params:
            raise CheckpointError(f"{path}: tensor {key!r} matches no adapter parameter")
        groups[group][name] = t
    step = _int_field(meta, "optimizer_step", path.with_name(STATE_META))
    snap.optimizer = OptimizerState(step, groups["exp_avg"], groups["exp_avg_sq"])
    snap.grads = groups["grad"]
    snap.pending_grad_passes = _int_field(meta, "pending_grad_passes", path.with_name(STATE_META))


def _int_field(obj: dict[str, object], name: str, where: Path) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool):
        raise CheckpointError(f"{where}: field {name!r} must be an integer, got {value!r}")
    return value


def _check_factor(key: str, t: torch.Tensor, layers: dict[str, MultiLoraLinear], spec: LoraSpec,
                  where: Path | None) -> None:
    layer_name, _, factor = key.rpartition(".")
    layer = layers.get(layer_name)
    if layer is None:
        raise CheckpointError(f"{where}: layer {layer_name!r} does not exist in this base model")
    if layer_name.rsplit(".", 1)[-1] not in target_suffixes(spec.train_attn, spec.train_mlp,
                                                        spec.train_unembed):
        raise CheckpointError(f"{where}: layer {layer_name!r} is outside the spec's targets")
    want = (spec.rank, layer.in_features) if factor == "lora_A" else (layer.out_features, spec.rank)
    if tuple(t.shape) != want:
        raise CheckpointError(f"{where}: {key} has shape {tuple(t.shape)} but this base model needs "
                              f"{want} (a different base model?)")


def _matching(tensors: dict[str, torch.Tensor], params: dict[str, nn.Parameter],
              what: str) -> dict[str, torch.Tensor]:
    """`tensors` on the params' device, each checked to have its parameter's shape."""
    out: dict[str, torch.Tensor] = {}
    for key, t in tensors.items():
        p = params[key]
        if t.shape != p.shape:
            raise CheckpointError(f"{what} of {key} has shape {tuple(t.shape)}, its parameter "
                                  f"{tuple(p.shape)}")
        out[key] = t.to(device=p.device, dtype=p.dtype)
    return out
