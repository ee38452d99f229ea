"""Adapter checkpoints (`worker.engine.checkpoints` through `Engine.save_adapter` / `load_adapter`).

Acceptance: a checkpoint saved with the optimizer (and pending gradients) and loaded in a fresh process
continues training exactly as if it never stopped (<= 1e-6; in practice bit-for-bit); the PEFT files load
in `peft.PeftModel.from_pretrained` and give the engine's logprobs (<= 1e-5). Plus the file format,
atomic writes, adapters written by peft itself, and clear errors for bad checkpoints.

Run as a script, this module is the fresh process: it loads a checkpoint and continues training.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from services.domain.training import AdamParams, AdapterId, Datum, ForwardBackwardWork, LoraSpec
from worker.engine import checkpoints
from worker.engine.checkpoints import CheckpointError, spec_from_peft_config
from worker.engine.engine import Engine, EngineConfig

REPO = Path(__file__).resolve().parents[2]
HP = AdamParams(learning_rate=1e-2)
AID = AdapterId("tenant-a")


def _engine(model_dir: Path) -> Engine:
    return Engine(model_dir, name="tiny", config=EngineConfig(device="cpu", dtype="float32"))


def _data(seed: int, vocab: int = 512, lengths: tuple[int, ...] = (7, 12, 5)) -> list[Datum]:
    rng = np.random.default_rng(seed)
    data = []
    for n in lengths:
        seq = rng.integers(0, vocab, n + 1)
        data.append(Datum(seq[:-1].astype(np.int64), {"target_tokens": seq[1:].astype(np.int64)}))
    return data


def _fb(engine: Engine, aid: AdapterId, data: list[Datum], *, forward_only: bool = False) -> list[np.ndarray]:
    (result,) = engine.forward_backward([ForwardBackwardWork(aid, data, forward_only=forward_only)])
    assert not hasattr(result, "message"), result
    return [o.logprobs for o in result.outputs]


def _train(engine: Engine, aid: AdapterId, data: list[Datum], steps: int) -> None:
    for _ in range(steps):
        _fb(engine, aid, data)
        engine.optim_step(aid, HP)


def _factors(engine: Engine, aid: AdapterId) -> dict[str, torch.Tensor]:
    return {k: p.detach().clone() for k, p in engine.adapter(aid).params.items()}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Engine:
    return _engine(tiny_model_dir)


@pytest.fixture
def trained(engine: Engine) -> AdapterId:
    """Two AdamW steps, then one more forward_backward: moments, a step count and pending gradients."""
    engine.create_adapter(AID, LoraSpec(rank=4, alpha=8.0, seed=None))
    _train(engine, AID, _data(1), steps=2)
    _fb(engine, AID, _data(2))
    return AID


# -- acceptance a: resume in a fresh process ---------------------------------------------------------
def _continue_main(argv: list[str]) -> None:
    """The fresh process: load `ckpt` with its optimizer, finish the pending step, train on, save factors."""
    model_dir, ckpt, out, steps, threads = argv
    torch.set_num_threads(int(threads))  # the parent's thread count: same reductions, same bits
    engine = _engine(Path(model_dir))
    engine.load_adapter(AID, Path(ckpt), with_optimizer=True)
    engine.optim_step(AID, HP)
    _train(engine, AID, _data(3), steps=int(steps))
    save_file(_factors(engine, AID), out)


def test_resume_in_fresh_process_equals_never_stopping(engine: Engine, trained: AdapterId,
                                                       tiny_model_dir: Path, tmp_path: Path) -> None:
    engine.save_adapter(trained, tmp_path / "ckpt", with_optimizer=True)
    out = tmp_path / "resumed.safetensors"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    args = [str(tiny_model_dir), str(tmp_path / "ckpt"), str(out), "3", str(torch.get_num_threads())]
    proc = subprocess.run([sys.executable, __file__, *args], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    engine.optim_step(trained, HP)
    _train(engine, trained, _data(3), steps=3)
    resumed, never_stopped = load_file(out), _factors(engine, trained)
    assert resumed.keys() == never_stopped.keys()
    for key, value in never_stopped.items():
        assert (resumed[key] - value).abs().max().item() <= 1e-6, key


def test_round_trip_restores_training_state_bit_for_bit(engine: Engine, trained: AdapterId,
                                                        tmp_path: Path) -> None:
    written = engine.save_adapter(trained, tmp_path / "ckpt", with_optimizer=True)
    files = {p.name: p.stat().st_size for p in (tmp_path / "ckpt").iterdir()}
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors", "carpool_state.safetensors",
                          "carpool_state.json"}
    assert written == sum(files.values())
    src = engine.adapter(trained)
    spec = engine.load_adapter(AdapterId("copy"), tmp_path / "ckpt", with_optimizer=True)
    assert spec == LoraSpec(rank=4, alpha=8.0, seed=src.seed)  # the drawn seed is kept
    src, copy = engine.adapter(trained), engine.adapter(AdapterId("copy"))
    assert copy.optimizer.step == src.optimizer.step == 2
    assert copy.pending_grad_passes == src.pending_grad_passes == 1
    src_grads, copy_grads = src.grads(), copy.grads()
    assert set(src_grads) == set(src.params)
    for key, p in src.params.items():
        assert torch.equal(copy.params[key], p) and torch.equal(copy_grads[key], src_grads[key])
        assert torch.equal(copy.optimizer.exp_avg[key], src.optimizer.exp_avg[key])
        assert torch.equal(copy.optimizer.exp_avg_sq[key], src.optimizer.exp_avg_sq[key])


def test_load_without_optimizer_gives_fresh_optimizer(engine: Engine, trained: AdapterId,
                                                      tmp_path: Path) -> None:
    engine.save_adapter(trained, tmp_path / "ckpt", with_optimizer=True)
    engine.load_adapter(AdapterId("weights"), tmp_path / "ckpt", with_optimizer=False)
    state = engine.adapter(AdapterId("weights"))
    assert state.optimizer.step == 0 and not state.optimizer.exp_avg and state.pending_grad_passes == 0
    assert state.grads() == {} and all(p.grad is None for p in state.params.values())
    for key, p in engine.adapter(trained).params.items():
        assert torch.equal(state.params[key], p)


# -- acceptance b: peft loads the export with the same logits -----------------------------------------
@pytest.mark.parametrize("spec", [
    LoraSpec(rank=4, alpha=8.0, seed=3),
    LoraSpec(rank=8, alpha=16.0, seed=5, train_mlp=False, train_unembed=False),
    LoraSpec(rank=2, alpha=32.0, seed=6, train_attn=False),
], ids=["all", "attn", "mlp+unembed"])
def test_peft_loads_export_with_same_logits(engine: Engine, tiny_model_dir: Path, tmp_path: Path,
                                            spec: LoraSpec) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.reference.peft_reference import reference_logprobs

    aid = AdapterId(f"peft-{spec.rank}")
    engine.create_adapter(aid, spec)
    _train(engine, aid, _data(4), steps=2)  # B leaves zero: the adapter changes the logits
    engine.save_adapter(aid, tmp_path / "peft", with_optimizer=False)
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    params = engine.adapter(aid).params
    suffixes = {name.rsplit(".", 1)[-1] for name in engine.lm.layers if f"{name}.lora_A" in params}
    assert config["target_modules"] == sorted(suffixes)
    assert (config["r"], config["lora_alpha"]) == (spec.rank, spec.alpha)
    assert config["base_model_name_or_path"] == "tiny"  # the engine's public model name

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "peft").eval()
    data = _data(5)
    ours = _fb(engine, aid, data, forward_only=True)
    base_lp = _fb(engine, None, data, forward_only=True)  # type: ignore[arg-type]
    with torch.no_grad():
        for datum, lp, lp0 in zip(data, ours, base_lp, strict=True):
            ref = reference_logprobs(model, datum.tokens, datum.loss_inputs["target_tokens"]).numpy()
            assert np.abs(lp - ref).max() <= 1e-5
            assert np.abs(lp - lp0).max() > 1e-4  # the comparison is not vacuous


def test_adapter_written_by_peft_loads(engine: Engine, tiny_model_dir: Path, tmp_path: Path) -> None:
    from tests.reference.peft_reference import peft_model

    gen = torch.Generator().manual_seed(0)
    source = engine.adapter(_created(engine, AdapterId("src"), LoraSpec(rank=4, alpha=6.0, seed=9,
                                                                        train_unembed=False)))
    factors = {k: torch.randn(p.shape, generator=gen) * 0.05 for k, p in source.params.items()}
    peft_model(tiny_model_dir, 4, 6.0, factors, train_unembed=False).save_pretrained(tmp_path / "by-peft")
    spec = engine.load_adapter(AdapterId("from-peft"), tmp_path / "by-peft", with_optimizer=False)
    assert spec == LoraSpec(rank=4, alpha=6.0, seed=None, train_unembed=False)
    loaded = _factors(engine, AdapterId("from-peft"))
    assert loaded.keys() == factors.keys()
    assert all(torch.equal(loaded[k], v) for k, v in factors.items())


def _created(engine: Engine, aid: AdapterId, spec: LoraSpec) -> AdapterId:
    engine.create_adapter(aid, spec)
    return aid


def test_peft_config_mapping_is_best_effort(tmp_path: Path) -> None:
    rs = spec_from_peft_config({"peft_type": "LORA", "r": 4, "lora_alpha": 8, "use_rslora": True},
                               ["q_proj", "down_proj"], tmp_path)
    assert (rs.train_attn, rs.train_mlp, rs.train_unembed) == (True, True, False)
    assert math.isclose(rs.scale, 8 / math.sqrt(4))  # rsLoRA's alpha/sqrt(r), as our alpha/r
    with pytest.raises(CheckpointError, match="use_dora"):
        spec_from_peft_config({"r": 4, "use_dora": True}, ["q_proj"], tmp_path)
    with pytest.raises(CheckpointError, match="'r'"):
        spec_from_peft_config({"lora_alpha": 4}, ["q_proj"], tmp_path)


# -- atomic writes and errors ----------------------------------------------------------------------------
def test_overwrite_is_atomic_and_leaves_no_temp_dirs(engine: Engine, trained: AdapterId, tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    dest = tmp_path / "ckpt"
    engine.save_adapter(trained, dest, with_optimizer=True)
    engine.save_adapter(trained, dest, with_optimizer=False)  # replaces the full checkpoint
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    def fail(path: Path, data: bytes) -> int:
        raise OSError("disk full")

    monkeypatch.setattr(checkpoints, "_write_file", fail)
    with pytest.raises(OSError, match="disk full"):
        engine.save_adapter(trained, dest, with_optimizer=True)
    with pytest.raises(OSError, match="disk full"):
        engine.save_adapter(trained, tmp_path / "new", with_optimizer=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no partial dirs, no temp dirs
    assert sorted(p.name for p in dest.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]


def test_refuses_to_replace_a_foreign_directory(engine: Engine, trained: AdapterId, tmp_path: Path) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "precious.txt").write_text("keep me")
    with pytest.raises(CheckpointError, match="precious.txt"):
        engine.save_adapter(trained, tmp_path / "data", with_optimizer=False)
    assert (tmp_path / "data" / "precious.txt").read_text() == "keep me"


def test_missing_files_name_the_path(engine: Engine, trained: AdapterId, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="nowhere"):
        engine.load_adapter(AdapterId("x"), tmp_path / "nowhere", with_optimizer=False)
    engine.save_adapter(trained, tmp_path / "w", with_optimizer=False)
    with pytest.raises(CheckpointError, match="carpool_state.json"):
        engine.load_adapter(AdapterId("x"), tmp_path / "w", with_optimizer=True)
    (tmp_path / "w" / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="adapter_model.safetensors"):
        engine.load_adapter(AdapterId("x"), tmp_path / "w", with_optimizer=False)
    assert not engine.has_adapter(AdapterId("x"))


@pytest.mark.parametrize("edit, message", [
    ("narrow", r"model\.layers\.0\.mlp\.down_proj\.lora_A has shape \(4, \d+\) but this base model needs"),
    ("rename", "model.layers.7.mlp.down_proj.*does not exist in this base model"),
    ("drop_b", "has no matching .*lora_B"),
])
def test_base_model_mismatch_is_a_clear_error(engine: Engine, trained: AdapterId, tmp_path: Path,
                                              edit: str, message: str) -> None:
    engine.save_adapter(trained, tmp_path / "ckpt", with_optimizer=True)
    weights_path = tmp_path / "ckpt" / "adapter_model.safetensors"
    weights = load_file(weights_path)
    key = "base_model.model.model.layers.0.mlp.down_proj.lora_A.weight"
    if edit == "narrow":
        weights[key] = weights[key][:, :-1].contiguous()  # a base model with a narrower MLP
    elif edit == "rename":
        weights[key.replace("layers.0", "layers.7")] = weights.pop(key)
        b_key = key.replace("lora_A", "lora_B")
        weights[b_key.replace("layers.0", "layers.7")] = weights.pop(b_key)
    else:
        del weights[key.replace("lora_A", "lora_B")]
    save_file(weights, weights_path)
    before = _factors(engine, trained)
    with pytest.raises(CheckpointError, match=message):
        engine.load_adapter(trained, tmp_path / "ckpt", with_optimizer=False)
    after = _factors(engine, trained)  # a failed load leaves the adapter it would replace alone
    assert all(torch.equal(after[k], v) for k, v in before.items())


if __name__ == "__main__":
    _continue_main(sys.argv[1:])
