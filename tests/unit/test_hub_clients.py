"""Hub clients at the `HfApi` / `HubApi` boundary (recording fakes), bound to the real installed signatures;
failure classification; token encryption; the upload folder and model card."""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any

import pytest

from services.hub.card import CardError, CardFacts, build_upload_folder, model_card, read_steps
from services.hub.clients import HubError, HuggingFaceClient, ModelScopeClient, PushRequest, classify
from services.hub.credentials import CredentialError, TokenCipher
from tests.hub_fakes import FakeHfApi, FakeHTTPError, FakeMsHubApi, bind_to_real_signatures

TOKEN = "hf_secretsecretsecret"


def _folder(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    folder = tmp_path / "upload"
    folder.mkdir(parents=True)
    files = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights", "README.md": b"card"}
    for name, data in files.items():
        (folder / name).write_bytes(data)
    return folder, {n: hashlib.sha256(d).hexdigest() for n, d in files.items()}


def _request(tmp_path: Path, *, revision: str | None = None, push_id: int = 7) -> PushRequest:
    folder, files = _folder(tmp_path)
    return PushRequest("acme/adapter", folder, TOKEN, True, revision, "Upload adapter", f"carpool-push: {push_id}",
                       files)


def _ms_upload_delegate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """What `modelscope.hub.api.HubApi.upload_folder` forwards to `modelscope_hub`'s implementation."""
    from modelscope_hub.api import HubApi as Inner

    forwarded = {k: v for k, v in kwargs.items() if k not in ("repo_type", "token", "folder_path")}
    inspect.signature(Inner.upload_folder).bind(object(), repo_id=args[0], repo_type="model",
                                                folder_path=kwargs.get("folder_path"), **forwarded)


def test_hf_push_creates_repo_branch_and_one_commit(tmp_path: Path) -> None:
    api = FakeHfApi()
    result = HuggingFaceClient(api).push(_request(tmp_path, revision="v1"))
    assert result.created and result.revision == api.commits("acme/adapter", "v1")[0].commit_id
    assert result.url.endswith(f"/acme/adapter/commit/{result.revision}")
    assert [c[0] for c in api.calls] == ["create_repo", "create_branch", "list_repo_commits", "upload_folder"]
    assert api.repos["acme/adapter"].private
    assert sorted(api.repos["acme/adapter"].files) == ["README.md", "adapter_config.json",
                                                       "adapter_model.safetensors"]
    upload = api.calls[-1][2]
    assert upload["token"] == TOKEN and upload["commit_description"] == "carpool-push: 7"


def test_hf_retry_after_a_crash_does_not_commit_twice(tmp_path: Path) -> None:
    api = FakeHfApi()
    client = HuggingFaceClient(api)
    client.push(_request(tmp_path))
    again = client.push(_request(tmp_path / "retry"))
    assert not again.created and len(api.commits("acme/adapter")) == 1
    other = client.push(_request(tmp_path / "other", push_id=8))  # another push of the same repo does commit
    assert other.created and len(api.commits("acme/adapter")) == 2


def test_ms_push_and_retry_skip_when_files_are_there(tmp_path: Path) -> None:
    api = FakeMsHubApi()
    client = ModelScopeClient(api)
    first = client.push(_request(tmp_path))
    assert first.created and first.url == "https://modelscope.cn/models/acme/adapter"
    assert api.calls[0] == ("create_repo", ("acme/adapter",),
                            {"token": TOKEN, "visibility": "private", "repo_type": "model", "exist_ok": True})
    again = client.push(_request(tmp_path / "retry"))
    assert not again.created and len(api.commits("acme/adapter")) == 1


def test_every_recorded_call_binds_to_the_installed_libraries(tmp_path: Path) -> None:
    from huggingface_hub import HfApi
    from modelscope.hub.api import HubApi

    hf = FakeHfApi()
    HuggingFaceClient(hf).push(_request(tmp_path / "a", revision="dev"))
    HuggingFaceClient(hf).push(_request(tmp_path / "b", revision="dev"))
    assert bind_to_real_signatures(hf.calls, HfApi) == 7
    ms = FakeMsHubApi()
    ModelScopeClient(ms).push(_request(tmp_path / "c"))
    assert bind_to_real_signatures(ms.calls, HubApi, {"upload_folder": _ms_upload_delegate}) == 3
    with pytest.raises(TypeError):  # the check has teeth: a misspelt keyword is refused
        bind_to_real_signatures([("upload_folder", (), {"repo_id": "a/b", "folder": "x"})], HfApi)


@pytest.mark.parametrize(("exc", "transient"), [
    (FakeHTTPError(401), False), (FakeHTTPError(403), False), (FakeHTTPError(404), False),
    (FakeHTTPError(400), False), (FakeHTTPError(429), True), (FakeHTTPError(500), True), (FakeHTTPError(503), True),
    (ConnectionError("refused"), True), (TimeoutError("slow"), True), (ValueError("bad"), False),
])
def test_failures_are_classified(exc: Exception, transient: bool) -> None:
    error = classify(exc, "uploading")
    assert error.transient is transient and str(error).startswith("uploading: ")


def test_real_library_errors_are_classified() -> None:
    import httpx

    assert classify(httpx.ConnectError("refused"), "x").transient
    assert classify(httpx.ReadTimeout("slow"), "x").transient


def test_hub_errors_surface_from_the_client(tmp_path: Path) -> None:
    api = FakeHfApi()
    api.fail_next("upload_folder", FakeHTTPError(403, "Forbidden: no write access"))
    with pytest.raises(HubError, match=r"uploading: HTTP 403 \(the token may not write to this repo\)") as info:
        HuggingFaceClient(api).push(_request(tmp_path))
    assert not info.value.transient


def test_tokens_encrypt_and_only_decrypt_with_the_same_key() -> None:
    cipher = TokenCipher.from_setting("k" * 32)
    sealed = cipher.encrypt(TOKEN)
    assert TOKEN not in sealed and cipher.decrypt(sealed) == TOKEN
    assert cipher.encrypt(TOKEN) != sealed  # randomised
    with pytest.raises(CredentialError, match="cannot be decrypted"):
        TokenCipher.from_setting("j" * 32).decrypt(sealed)
    with pytest.raises(CredentialError, match="at least 32"):
        TokenCipher.from_setting("short")


def test_card_and_upload_folder(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "carpool_state.safetensors"):
        (ckpt / name).write_bytes(b"x")
    (ckpt / "carpool_state.json").write_text('{"optimizer_step": 12}')
    facts = CardFacts("org/base", 8, "sess:train:0", "tinker://sess:train:0/weights/w", read_steps(ckpt))
    files = build_upload_folder(ckpt, tmp_path / "up", facts)
    assert sorted(files) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    card = (tmp_path / "up" / "README.md").read_text()
    assert card.startswith('---\nbase_model: "org/base"\nlibrary_name: peft\ntags:\n')
    assert "| LoRA rank | 8 |" in card and "| Optimizer steps | 12 |" in card and "sess:train:0" in card
    assert "steps | unknown" in model_card(CardFacts("b", 1, "r", "p", None)).replace("Optimizer steps", "steps")
    (ckpt / "adapter_model.safetensors").unlink()
    with pytest.raises(CardError, match="missing adapter_model.safetensors"):
        build_upload_folder(ckpt, tmp_path / "up2", facts)
