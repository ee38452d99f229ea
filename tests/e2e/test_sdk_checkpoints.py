"""Checkpoints through the unmodified `tinker` SDK against `carpool serve` (issue item 1, checkpoint half).

* `save_state` → `create_training_client_from_state_with_optimizer` continues with exactly the losses of an
  uninterrupted run (a twin model with the same LoRA seed, data and learning rate), over every loss; without
  the optimizer state the losses diverge, so the check is not vacuous.
* `RestClient`: training runs, a run's checkpoints and the user's checkpoints, weights info, TTLs,
  publishing (another tenant can load a published checkpoint and only then), deletion, sessions,
  server capabilities.
* External weights: a plain PEFT export downloaded through `get_external_weights_urls` loads in peft and
  gives the server's logprobs; the `tinker_cookbook.weights.download` flow for a `weights/` checkpoint
  (create-from-state, `save_weights_external` age-encrypted to a throw-away key, download, decrypt,
  delete the export) yields the same adapter. tinker-cookbook 0.6.1 itself does not install here (it
  needs tml-renderers>=0.4.1), so its steps are replayed with the SDK, httpx and pyrage.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import numpy as np
import pyrage
import pytest
import tinker
import torch
from safetensors.torch import load_file
from tinker import types

from tests.e2e.server import Server

LR = 5e-3
LOSSES: list[tuple[str, dict[str, float]]] = [
    ("cross_entropy", {}),
    ("importance_sampling", {}),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("cispo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}),
    ("dro", {"beta": 0.1}),
    ("cross_entropy", {}),
]
SAVE_AFTER = 3


@pytest.fixture(scope="module")
def owner_key(server: Server) -> str:
    return server.create_tenant("ckpt-owner")


@pytest.fixture(scope="module")
def service(server: Server, owner_key: str) -> Iterator[tinker.ServiceClient]:
    client = tinker.ServiceClient(base_url=server.url, api_key=owner_key)
    yield client
    client.close("success").result()


@pytest.fixture(scope="module")
def rest(server: Server, owner_key: str) -> tinker.RestClient:
    return tinker.RestClient(base_url=server.url, api_key=owner_key)


def _batch(step: int, loss_fn: str) -> list[types.Datum]:
    """Step `step`'s data: fixed tokens; RL inputs carry fixed sampler logprobs and advantages."""
    rng = np.random.default_rng(100 + step)
    out = []
    for _ in range(3):
        seq = rng.integers(1, 512, int(rng.integers(6, 11)))
        n = len(seq) - 1
        inputs: dict[str, object] = {"target_tokens": seq[1:].tolist()}
        if loss_fn == "cross_entropy":
            inputs["weights"] = [1.0] * n
        else:
            inputs["logprobs"] = types.TensorData.from_numpy((-6.2 + rng.normal(0, 0.1, n)).astype(np.float32))
            inputs["advantages"] = types.TensorData.from_numpy(rng.normal(0.2, 1.0, n).astype(np.float32))
        out.append(types.Datum(model_input=types.ModelInput.from_ints(seq[:-1].tolist()),
                               loss_fn_inputs=inputs))  # type: ignore[arg-type]
    return out


def _train(client: tinker.TrainingClient, steps: range) -> list[float]:
    losses = []
    for step in steps:
        loss_fn, config = LOSSES[step]
        fb = client.forward_backward(_batch(step, loss_fn), loss_fn, config)
        opt = client.optim_step(types.AdamParams(learning_rate=LR))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def _probe_data() -> list[types.Datum]:
    seqs = [[3, 17, 99, 240, 8, 77, 301, 5], [450, 12, 12, 88, 190, 2]]
    return [types.Datum(model_input=types.ModelInput.from_ints(s[:-1]),
                        loss_fn_inputs={"target_tokens": s[1:], "weights": [1.0] * (len(s) - 1)}) for s in seqs]


def _forward_logprobs(client: tinker.TrainingClient) -> list[np.ndarray]:
    out = client.forward(_probe_data(), "cross_entropy").result()
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def _max_diff(a: Sequence[np.ndarray], b: Sequence[np.ndarray]) -> float:
    return max(float(np.abs(x - y).max()) for x, y in zip(a, b, strict=True))


def test_resume_with_optimizer_continues_exactly(service: tinker.ServiceClient, base_model: str) -> None:
    uninterrupted = service.create_lora_training_client(base_model=base_model, rank=4, seed=7).result()
    expected = _train(uninterrupted, range(len(LOSSES)))

    first = service.create_lora_training_client(base_model=base_model, rank=4, seed=7).result()
    before = _train(first, range(SAVE_AFTER))
    path = first.save_state("mid").result().path
    assert path == f"tinker://{first.model_id}/weights/mid"
    resumed = service.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != first.model_id
    after = _train(resumed, range(SAVE_AFTER, len(LOSSES)))
    np.testing.assert_allclose(before + after, expected, rtol=0, atol=1e-5)
    assert _max_diff(_forward_logprobs(resumed), _forward_logprobs(uninterrupted)) <= 1e-5
    # Saving did not disturb the original model either.
    np.testing.assert_allclose(_train(first, range(SAVE_AFTER, len(LOSSES))), after, rtol=0, atol=1e-5)

    # Weights only (a fresh optimizer): the first step after the load sees the same weights, the next
    # ones diverge — the optimizer state above was really restored.
    weights_only = service.create_training_client_from_state(path).result()
    fresh = _train(weights_only, range(SAVE_AFTER, len(LOSSES)))
    assert fresh[0] == pytest.approx(after[0], abs=1e-5)
    assert max(abs(a - b) for a, b in zip(fresh[1:], after[1:], strict=True)) > 1e-3


def test_rest_client_lists_publishes_expires_and_deletes(server: Server, service: tinker.ServiceClient,
                                                         rest: tinker.RestClient, base_model: str) -> None:
    model = service.create_lora_training_client(base_model=base_model, rank=4, seed=8,
                                                user_metadata={"purpose": "rest"}).result()
    _train(model, range(1))
    ck = model.save_state("ck-a", user_metadata={"stage": "one"}).result().path
    ttl_ck = model.save_state("ck-ttl", ttl_seconds=3600).result().path
    sampler = model.save_weights_for_sampler("s-a").result().path
    run_id = model.model_id
    assert sampler == f"tinker://{run_id}/sampler_weights/s-a"

    runs = rest.list_training_runs(limit=100).result()
    assert run_id in {r.training_run_id for r in runs.training_runs}
    assert runs.cursor is not None and runs.cursor.total_count == len(runs.training_runs)
    run = rest.get_training_run(run_id).result()
    assert (run.base_model, run.is_lora, run.lora_rank) == (base_model, True, 4)
    assert run.last_checkpoint is not None and run.last_checkpoint.checkpoint_id == "weights/ck-ttl"
    assert run.last_sampler_checkpoint is not None and run.last_sampler_checkpoint.tinker_path == sampler
    assert run.user_metadata == {"purpose": "rest"}
    assert rest.get_training_run_by_tinker_path(ck).result().training_run_id == run_id

    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert set(listed) == {"weights/ck-a", "weights/ck-ttl", "sampler_weights/s-a"}
    assert [listed[k].checkpoint_type for k in sorted(listed)] == ["sampler", "training", "training"]
    assert listed["weights/ck-a"].tinker_path == ck and listed["weights/ck-a"].user_metadata == {"stage": "one"}
    assert listed["weights/ck-a"].expires_at is None and not listed["weights/ck-a"].public
    assert all((c.size_bytes or 0) > 0 for c in listed.values())
    _assert_expires_in(listed["weights/ck-ttl"].expires_at, 3600)
    mine = {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    assert {ck, ttl_ck, sampler} <= mine
    info = rest.get_weights_info_by_tinker_path(ck).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == (base_model, True, 4)

    # TTL: set, clear, refuse out of range.
    rest.set_checkpoint_ttl_from_tinker_path(ck, 7200).result()
    _assert_expires_in(_checkpoint(rest, run_id, "weights/ck-a").expires_at, 7200)
    rest.set_checkpoint_ttl_from_tinker_path(ttl_ck, None).result()
    assert _checkpoint(rest, run_id, "weights/ck-ttl").expires_at is None
    with pytest.raises(tinker.BadRequestError):
        rest.set_checkpoint_ttl_from_tinker_path(ck, 60).result()

    # Another tenant sees nothing of ours until a checkpoint is published.
    other_key = server.create_tenant("ckpt-other")
    other = tinker.ServiceClient(base_url=server.url, api_key=other_key)
    other_rest = tinker.RestClient(base_url=server.url, api_key=other_key)
    assert run_id not in {r.training_run_id for r in other_rest.list_training_runs().result().training_runs}
    with pytest.raises(tinker.NotFoundError):
        other_rest.get_training_run(run_id).result()
    with pytest.raises(tinker.NotFoundError, match="not found"):
        other.create_training_client_from_state(ck).result()
    rest.publish_checkpoint_from_tinker_path(ck).result()
    assert _checkpoint(rest, run_id, "weights/ck-a").public
    borrowed = other.create_training_client_from_state(ck).result()
    assert borrowed.get_info().model_data.model_name == base_model
    rest.unpublish_checkpoint_from_tinker_path(ck).result()
    assert not _checkpoint(rest, run_id, "weights/ck-a").public
    with pytest.raises(tinker.NotFoundError, match="not found"):
        other.create_training_client_from_state(ck).result()
    original = _forward_logprobs(model)
    assert _max_diff(_forward_logprobs(borrowed), original) <= 1e-6  # the copy kept what it loaded
    other.close("success").result()

    # Sessions know the run; capabilities list the served model.
    session_id = run_id.split(":train:")[0]
    assert session_id in rest.list_sessions(limit=100).result().sessions
    assert run_id in rest.get_session(session_id).result().training_run_ids
    models = rest.get_server_capabilities().result().supported_models
    assert base_model in {m.model_name for m in models}

    # Delete: gone from the listings, no longer loadable.
    rest.delete_checkpoint_from_tinker_path(ck).result()
    assert "weights/ck-a" not in {c.checkpoint_id for c in rest.list_checkpoints(run_id).result().checkpoints}
    assert ck not in {c.tinker_path for c in rest.list_user_checkpoints(limit=1000).result().checkpoints}
    with pytest.raises(tinker.NotFoundError, match="not found"):
        service.create_training_client_from_state(ck).result()


def _checkpoint(rest: tinker.RestClient, run_id: str, checkpoint_id: str) -> types.Checkpoint:
    listed = {c.checkpoint_id: c for c in rest.list_checkpoints(run_id).result().checkpoints}
    return listed[checkpoint_id]


def _assert_expires_in(expires_at: datetime | None, seconds: int) -> None:
    assert expires_at is not None
    expected = datetime.now(UTC) + timedelta(seconds=seconds)
    assert abs((expires_at - expected).total_seconds()) < 120, (expires_at, expected)


# -- external weights -------------------------------------------------------------------------------------
def _download(rest: tinker.RestClient, tinker_path: str, out: Path) -> dict[str, Path]:
    urls = rest.get_external_weights_urls(tinker_path).result()
    assert urls.expires > datetime.now(UTC)
    files = {}
    for name, url in urls.urls.items():
        response = httpx.get(url, timeout=30)  # no API key: the signed URL is the credential
        assert response.status_code == 200, response.text
        files[name] = out / name
        files[name].write_bytes(response.content)
    return files


def test_external_weights_download_loads_in_peft(service: tinker.ServiceClient, rest: tinker.RestClient,
                                                 base_model: str, e2e_model_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.reference.peft_reference import reference_logprobs

    model = service.create_lora_training_client(base_model=base_model, rank=4, seed=9).result()
    _train(model, range(2))  # LoRA B starts at zero: train so the adapter matters
    export = model.save_weights_external("plain").result().path
    assert export == f"tinker://{model.model_id}/external_weights/plain"
    assert _checkpoint(rest, model.model_id, "external_weights/plain").checkpoint_type == "external"
    files = _download(rest, export, tmp_path)
    assert set(files) == {"adapter_config.json", "adapter_model.safetensors"}
    assert json.loads(files["adapter_config.json"].read_text())["r"] == 4

    base = AutoModelForCausalLM.from_pretrained(e2e_model_dir, dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, tmp_path).eval()
    served = _forward_logprobs(model)
    fresh = _forward_logprobs(service.create_lora_training_client(base_model=base_model, rank=4, seed=9).result())
    with torch.no_grad():
        ours = [reference_logprobs(peft_model, np.asarray(d.model_input.to_ints()),
                                   np.asarray(d.loss_fn_inputs["target_tokens"].tolist())).numpy()
                for d in _probe_data()]
    assert _max_diff(ours, served) <= 1e-5
    assert _max_diff(served, fresh) > 1e-3  # the trained adapter differs from the untrained one


def test_training_checkpoint_download_via_age_encrypted_export(service: tinker.ServiceClient,
                                                               rest: tinker.RestClient, base_model: str,
                                                               tmp_path: Path) -> None:
    model = service.create_lora_training_client(base_model=base_model, rank=4, seed=10).result()
    _train(model, range(2))
    state = model.save_state("for-download").result().path
    (tmp_path / "plain").mkdir()
    plain = _download(rest, model.save_weights_external("reference").result().path, tmp_path / "plain")

    # tinker_cookbook.weights.download(tinker_path=state, ...), step by step:
    identity = pyrage.x25519.Identity.generate()
    loaded = service.create_training_client_from_state(
        state, user_metadata={"created_by": "tinker_cookbook.weights.download"}).result()
    export = loaded.save_weights_external("download", ttl_seconds=3600,
                                          age_encryption_recipients=[str(identity.to_public())]).result().path
    (tmp_path / "encrypted").mkdir()
    encrypted = _download(rest, export, tmp_path / "encrypted")
    assert set(encrypted) == {"adapter_config.json.age", "adapter_model.safetensors.age"}
    rest.set_checkpoint_ttl_from_tinker_path(export, 3600).result()
    decrypted = {}
    for name, path in encrypted.items():
        assert path.read_bytes().startswith(b"age-encryption.org/v1")
        with pytest.raises(pyrage.DecryptError):  # another key cannot read it
            pyrage.decrypt(path.read_bytes(), [pyrage.x25519.Identity.generate()])
        target = path.with_name(name.removesuffix(".age"))
        pyrage.decrypt_file(str(path), str(target), [identity])
        decrypted[target.name] = target
    rest.delete_checkpoint_from_tinker_path(export).result()
    assert "external_weights/download" not in {
        c.checkpoint_id for c in rest.list_checkpoints(loaded.model_id).result().checkpoints}

    # The decrypted export of the loaded checkpoint is the live model's export.
    assert json.loads(decrypted["adapter_config.json"].read_text()) == json.loads(
        plain["adapter_config.json"].read_text())
    ours, reference = (load_file(str(decrypted["adapter_model.safetensors"])),
                       load_file(str(plain["adapter_model.safetensors"])))
    assert set(ours) == set(reference) and ours
    assert all(torch.equal(ours[k], reference[k]) for k in ours)


def test_bad_age_recipient_is_refused_and_the_model_carries_on(service: tinker.ServiceClient,
                                                               base_model: str) -> None:
    model = service.create_lora_training_client(base_model=base_model, rank=4, seed=11).result()
    with pytest.raises(tinker.BadRequestError, match="age_encryption_recipients"):
        model.save_weights_external("bad", age_encryption_recipients=["age1notakey"]).result()
    # The refused request consumed its seq_id: the model's next requests run.
    assert len(_forward_logprobs(model)) == 2
    ssh_key = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
    path = model.save_weights_external("to-ssh", age_encryption_recipients=[ssh_key]).result().path
    assert path.endswith("/external_weights/to-ssh")
