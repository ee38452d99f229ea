"""Bad input end to end, over HTTP against a real `carpool serve` with a small body limit.

A misbehaving tenant ("mallory") sends malformed protobuf, bad zstd, tensors of the wrong dtype or shape,
token ids outside the vocabulary, sequences over the context limit, unknown losses, bad JSON and
oversized bodies. Each gets a 4xx whose body names the offending field or limit — never a 5xx. Protobuf
bodies are built with the SDK's own encoder (`tinker/proto/request_conv.py`) and then corrupted.

Meanwhile a well-behaved tenant ("grace") trains in a background thread, and must finish every step. A
rejected submission still consumes its seq id (protocol §6.1), so after each bad request mallory's model
runs the next seq id at once: with raw HTTP, and with the SDK (a failing `forward_backward` followed by a
good one on the same `TrainingClient`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import zstandard
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from tests.e2e.server import Server, start_server
from tests.sdk_janitor import close_all

PROTOBUF = "application/x-protobuf"
BODY_LIMIT = 256 * 1024
"""`CARPOOL_MAX_BODY_BYTES` of this module's server (the default is 64 MiB)."""
TOKENS = [1, 5, 9, 13, 17, 21]
RESULT_TIMEOUT_S = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, e2e_model_dir: Path, e2e_mode: str) -> Iterator[Server]:
    """The dev-model server with a 256 KiB body limit (SDK chunks must fit in half of it); one per mode."""
    srv = start_server(tmp_path_factory.mktemp(f"carpool-bad-input-{e2e_mode}"), e2e_model_dir, mode=e2e_mode,
                       extra_env={
        "CARPOOL_MAX_BODY_BYTES": str(BODY_LIMIT),
        "CARPOOL_FWDBWD_MAX_CHUNK_BYTES_COUNT": str(BODY_LIMIT // 2),
    })
    try:
        yield srv
    finally:
        srv.stop()


# -- request building ---------------------------------------------------------------------------------
def datum(tokens: list[int] = TOKENS) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


def fwdbwd_message(model_id: str, seq_id: int, tokens: list[int] = TOKENS,
                   loss_fn: str = "cross_entropy") -> pb.ForwardBackwardRequest:
    """The protobuf the SDK itself would send (its own encoder)."""
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[datum(tokens)], loss_fn=loss_fn),  # type: ignore[arg-type]
        model_id=model_id,
        seq_id=seq_id,
    )
    return forward_backward_request_to_proto(request)


def proto(msg: pb.ForwardBackwardRequest) -> dict[str, Any]:
    return {"content": msg.SerializeToString(), "headers": {"Content-Type": PROTOBUF}}


@dataclass
class Model:
    """A model driven over raw HTTP, with its next seq id."""

    client: httpx.Client
    model_id: str
    next_seq: int = 1

    def take(self) -> int:
        seq, self.next_seq = self.next_seq, self.next_seq + 1
        return seq

    def forward_backward(self) -> httpx.Response:
        return self.client.post("/api/v1/forward_backward", **proto(fwdbwd_message(self.model_id, self.take())))

    def runs_next_request(self) -> None:
        """The model is not blocked: a good forward_backward at the next seq id completes."""
        submitted = self.forward_backward()
        assert submitted.status_code == 200, submitted.text
        result = wait_result(self.client, submitted.json()["request_id"], protobuf=True)
        assert result.headers["content-type"].startswith(PROTOBUF), result.text


def wait_result(client: httpx.Client, request_id: str, *, protobuf: bool = False) -> httpx.Response:
    headers = {"Accept": PROTOBUF} if protobuf else {}
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while time.monotonic() < deadline:
        answer = client.post("/api/v1/retrieve_future", json={"request_id": request_id}, headers=headers)
        answer.raise_for_status()
        if answer.headers["content-type"].startswith(PROTOBUF) or answer.json().get("type") != "try_again":
            return answer
    raise AssertionError(f"request {request_id} still pending after {RESULT_TIMEOUT_S}s: is the model blocked?")


def assert_rejected(response: httpx.Response, *fragments: str, status: int | None = None) -> dict[str, Any]:
    """A 4xx (never 5xx) with a JSON body whose text names every fragment (field, limit, value)."""
    assert 400 <= response.status_code < 500, (response.status_code, response.text)
    if status is not None:
        assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json"), response.headers
    body = response.json()
    assert isinstance(body, dict) and body.get("detail"), body
    for fragment in fragments:
        assert fragment in response.text, f"{fragment!r} not named in {body}"
    return body


# -- tenants ------------------------------------------------------------------------------------------
@dataclass
class Grace:
    """The well-behaved tenant training in the background while the barrage runs."""

    training: Any
    steps: int = 0
    errors: list[BaseException] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    def step(self) -> float:
        out = self.training.forward_backward([datum()], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
        self.training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)
        return float(out.metrics["loss:sum"])

    def run(self) -> None:
        while not self.stop.is_set():
            try:
                self.step()
                self.steps += 1
            except BaseException as exc:  # noqa: BLE001 - reported by the test that checks grace
                self.errors.append(exc)
                return
            time.sleep(0.05)


@pytest.fixture(scope="module")
def grace(server: Server, base_model: str) -> Iterator[Grace]:
    service = tinker.ServiceClient(base_url=server.url, api_key=server.create_tenant("grace"))
    tenant = Grace(service.create_lora_training_client(base_model=base_model, rank=4).result())
    tenant.step()
    tenant.thread = threading.Thread(target=tenant.run, name="grace-trains", daemon=True)
    tenant.thread.start()
    yield tenant
    tenant.stop.set()
    tenant.thread.join(timeout=60)
    close_all([service])  # finishes the session: its heartbeat stops


@pytest.fixture(scope="module")
def mallory_key(server: Server) -> str:
    return server.create_tenant("mallory")


@pytest.fixture(scope="module")
def mallory(server: Server, mallory_key: str, base_model: str, grace: Grace) -> Iterator[httpx.Client]:
    """Mallory's raw HTTP client (requesting `grace` makes sure grace trains during the barrage)."""
    del grace
    with httpx.Client(base_url=server.url, headers={"X-API-Key": mallory_key}, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def session_id(mallory: httpx.Client) -> str:
    answer = mallory.post("/api/v1/create_session", json={"tags": [], "user_metadata": {}, "sdk_version": "0.38.0"})
    answer.raise_for_status()
    return str(answer.json()["session_id"])


@pytest.fixture(scope="module")
def model(mallory: httpx.Client, session_id: str, base_model: str) -> Model:
    answer = mallory.post("/api/v1/create_model", json={
        "session_id": session_id, "model_seq_id": 0, "base_model": base_model, "lora_config": {"rank": 4},
    })
    answer.raise_for_status()
    assert "error" not in wait_result(mallory, answer.json()["request_id"]).json()
    return Model(mallory, answer.json()["model_id"])


@pytest.fixture(scope="module")
def limits(mallory: httpx.Client, base_model: str) -> dict[str, int]:
    models = mallory.get("/api/v1/get_server_capabilities").json()["supported_models"]
    (ours,) = [m for m in models if m["model_name"] == base_model]
    return {"max_context": int(ours["max_context_length"]), "vocab": 512}  # the e2e dev model's vocabulary


# -- protobuf and transport ---------------------------------------------------------------------------
def test_malformed_protobuf_is_400(model: Model) -> None:
    good = fwdbwd_message(model.model_id, model.next_seq).SerializeToString()
    for body in (b"\x0a\xff\xff\xff\xff\xff\xff", good[: len(good) // 2], b"\x12" + b"\xff" * 40):
        answer = model.client.post("/api/v1/forward_backward", content=body, headers={"Content-Type": PROTOBUF})
        assert_rejected(answer, "protobuf", status=400)
    # Nothing readable in them, so no seq id was taken: the next request still uses `next_seq`.
    model.runs_next_request()


def test_bad_zstd_is_400(model: Model) -> None:
    good = fwdbwd_message(model.model_id, model.next_seq).SerializeToString()
    garbage = {"Content-Type": PROTOBUF, "Content-Encoding": "zstd"}
    assert_rejected(model.client.post("/api/v1/forward_backward", content=b"not zstd at all", headers=garbage),
                    "zstd", status=400)
    truncated = zstandard.ZstdCompressor().compress(good)[:-6]
    assert_rejected(model.client.post("/api/v1/forward_backward", content=truncated, headers=garbage),
                    "zstd", status=400)
    assert_rejected(model.client.post("/api/v1/forward_backward", content=good,
                                      headers={"Content-Type": PROTOBUF, "Content-Encoding": "br"}),
                    "Content-Encoding", status=400)
    # A well-formed zstd body does work (the SDK sends these when told to).
    msg = fwdbwd_message(model.model_id, model.take())
    ok = model.client.post("/api/v1/forward_backward", content=zstandard.ZstdCompressor().compress(
        msg.SerializeToString()), headers=garbage)
    assert ok.status_code == 200, ok.text
    wait_result(model.client, ok.json()["request_id"], protobuf=True)
    model.runs_next_request()


def test_zstd_bomb_is_refused_naming_the_limit(model: Model) -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * (BODY_LIMIT * 8))
    assert len(bomb) < BODY_LIMIT
    answer = model.client.post("/api/v1/forward_backward", content=bomb,
                               headers={"Content-Type": PROTOBUF, "Content-Encoding": "zstd"})
    assert_rejected(answer, str(BODY_LIMIT), status=400)
    # Without a declared frame size the decoder's cap still holds.
    stream = zstandard.ZstdCompressor(write_content_size=False).compress(b"\0" * (BODY_LIMIT * 8))
    answer = model.client.post("/api/v1/forward_backward", content=stream,
                               headers={"Content-Type": PROTOBUF, "Content-Encoding": "zstd"})
    assert_rejected(answer, str(BODY_LIMIT), status=400)
    model.runs_next_request()


def test_oversized_bodies_are_413_naming_the_limit(model: Model) -> None:
    big = b"\0" * (BODY_LIMIT + 1)
    for path, headers in (("/api/v1/forward_backward", {"Content-Type": PROTOBUF}),
                          ("/api/v1/optim_step", {"Content-Type": "application/json"}),
                          ("/api/v1/asample", {"Content-Type": "application/json"}),
                          ("/api/v1/create_session", {})):
        body = assert_rejected(model.client.post(path, content=big, headers=headers), str(BODY_LIMIT), status=413)
        assert body.get("limit") == BODY_LIMIT and body.get("field") == "body"

    def chunks() -> Iterator[bytes]:  # no Content-Length: the limit applies while the body streams in
        for _ in range(BODY_LIMIT // 16384 + 2):
            yield b"\0" * 16384

    answer = model.client.post("/api/v1/forward_backward", content=chunks(), headers={"Content-Type": PROTOBUF})
    assert_rejected(answer, str(BODY_LIMIT), status=413)
    model.runs_next_request()


# -- tensors ------------------------------------------------------------------------------------------
Corruption = Callable[[pb.ForwardBackwardRequest], None]


def _retype(name: str, dtype: int, values: np.ndarray) -> Corruption:
    def corrupt(msg: pb.ForwardBackwardRequest) -> None:
        tensor = msg.data[0].loss_fn_inputs[name]
        tensor.dtype = dtype  # type: ignore[assignment]
        tensor.dense = values.tobytes()

    return corrupt


def _reshape(name: str, shape: list[int]) -> Corruption:
    def corrupt(msg: pb.ForwardBackwardRequest) -> None:
        del msg.data[0].loss_fn_inputs[name].shape[:]
        msg.data[0].loss_fn_inputs[name].shape.extend(shape)

    return corrupt


def _dense(name: str, raw: bytes) -> Corruption:
    def corrupt(msg: pb.ForwardBackwardRequest) -> None:
        msg.data[0].loss_fn_inputs[name].dense = raw

    return corrupt


def _drop(name: str) -> Corruption:
    def corrupt(msg: pb.ForwardBackwardRequest) -> None:
        del msg.data[0].loss_fn_inputs[name]

    return corrupt


def _sparse_targets(msg: pb.ForwardBackwardRequest) -> None:
    tensor = msg.data[0].loss_fn_inputs["target_tokens"]
    del tensor.shape[:]
    tensor.shape.extend([5, 2])
    tensor.sparse_csr.values = np.arange(3, dtype="<i8").tobytes()
    tensor.sparse_csr.crow_indices = np.array([0, 2, 1, 3, 3, 3], dtype="<i8").tobytes()  # not monotonic
    tensor.sparse_csr.col_indices = np.array([0, 1, 0], dtype="<i8").tobytes()


TARGETS = np.array(TOKENS[1:])
TENSOR_CASES: dict[str, tuple[Corruption, tuple[str, ...]]] = {
    "targets-as-float32": (_retype("target_tokens", pb.DTYPE_FLOAT32, TARGETS.astype("<f4")),
                           ("target_tokens.dtype", "int64")),
    "targets-bfloat16": (_retype("target_tokens", pb.DTYPE_BFLOAT16, TARGETS.astype("<i2")),
                         ("target_tokens.dtype", "DTYPE_BFLOAT16")),
    "targets-unspecified-dtype": (_retype("target_tokens", pb.DTYPE_UNSPECIFIED, TARGETS.astype("<i8")),
                                  ("target_tokens.dtype", "DTYPE_UNSPECIFIED")),
    "targets-unknown-dtype": (_retype("target_tokens", 99, TARGETS.astype("<i8")), ("target_tokens.dtype", "99")),
    "weights-as-int64": (_retype("weights", pb.DTYPE_INT64, np.ones(5, dtype="<i8")),
                         ("weights.dtype", "float32")),
    "targets-shape-too-big": (_reshape("target_tokens", [7]), ("target_tokens.shape", "7")),
    "targets-negative-dim": (_reshape("target_tokens", [-5]), ("target_tokens.shape", ">= 0")),
    "targets-misaligned": (_reshape("target_tokens", [1, 5]), ("target_tokens.shape", "len(model_input) = 5")),
    "weights-shape-differs": (_reshape("weights", [5, 1]), ("weights.shape", "[5, 1]")),
    "targets-ragged-bytes": (_dense("target_tokens", b"\1" * 13), ("target_tokens.dense", "multiple of 8")),
    "weights-nan": (_dense("weights", np.array([1, np.nan, 1, 1, 1], dtype="<f4").tobytes()),
                    ("weights", "finite")),
    "targets-missing": (_drop("target_tokens"), ("target_tokens", "required")),
    "targets-bad-csr": (_sparse_targets, ("target_tokens.sparse_crow_indices", "monoton")),
}


@pytest.mark.parametrize("case", list(TENSOR_CASES))
def test_bad_tensors_are_400_naming_the_field(model: Model, case: str) -> None:
    corrupt, fragments = TENSOR_CASES[case]
    msg = fwdbwd_message(model.model_id, model.take())
    corrupt(msg)
    body = assert_rejected(model.client.post("/api/v1/forward_backward", **proto(msg)),
                           "data[0].loss_fn_inputs", *fragments, status=400)
    assert body["field"].startswith("data[0].loss_fn_inputs.")
    model.runs_next_request()  # the rejected seq id was consumed


# -- tokens, context, losses, ids ---------------------------------------------------------------------
def test_token_ids_outside_the_vocabulary_are_400(model: Model, limits: dict[str, int]) -> None:
    vocab = limits["vocab"]
    for tokens, field_name in (([1, 2, vocab, 4], "model_input"), ([1, 2, 3, 10**9], "target_tokens"),
                               ([1, 2**31 - 1, 3], "model_input")):
        answer = model.client.post("/api/v1/forward_backward",
                                   **proto(fwdbwd_message(model.model_id, model.take(), tokens)))
        assert_rejected(answer, field_name, f"[0, {vocab})", "vocabulary", status=400)
        model.runs_next_request()
    answer = model.client.post("/api/v1/forward_backward",
                               **proto(fwdbwd_message(model.model_id, model.take(), [1, -7, 3])))
    assert_rejected(answer, "model_input", ">= 0", status=400)
    model.runs_next_request()


def test_sequences_over_the_context_limit_are_400(model: Model, limits: dict[str, int]) -> None:
    limit = limits["max_context"]
    tokens = [int(t) for t in np.arange(limit + 2) % 400 + 1]  # limit + 1 input tokens
    msg = fwdbwd_message(model.model_id, model.take(), tokens)
    assert len(msg.SerializeToString()) < BODY_LIMIT  # refused for its length, not its bytes
    assert_rejected(model.client.post("/api/v1/forward_backward", **proto(msg)),
                    "model_input", f"context limit of {limit}", status=400)
    model.runs_next_request()


@pytest.mark.parametrize("loss_fn", ["bogus_loss", "gspo_v2", "custom_loss", ""])
def test_unknown_loss_fn_is_400_naming_it(model: Model, loss_fn: str) -> None:
    answer = model.client.post("/api/v1/forward_backward",
                               **proto(fwdbwd_message(model.model_id, model.take(), loss_fn=loss_fn)))
    assert_rejected(answer, "loss_fn", loss_fn, status=400)
    model.runs_next_request()


def test_bad_ids_in_protobuf_are_400(model: Model) -> None:
    msg = fwdbwd_message(model.model_id, 0)
    assert_rejected(model.client.post("/api/v1/forward_backward", **proto(msg)), "seq_id", ">= 1", status=400)
    msg = fwdbwd_message("", 5)
    assert_rejected(model.client.post("/api/v1/forward_backward", **proto(msg)), "model_id", status=400)
    msg = fwdbwd_message(model.model_id, model.take())
    del msg.data[:]
    assert_rejected(model.client.post("/api/v1/forward_backward", **proto(msg)), "data", "datum", status=400)
    msg = fwdbwd_message(model.model_id, model.take())
    msg.data[0].model_input[0].image.data = b"\x89PNG"
    assert_rejected(model.client.post("/api/v1/forward_backward", **proto(msg)), "model_input", "image",
                    status=400)
    msg = fwdbwd_message(model.model_id, model.take())
    msg.loss_fn_config["clip"] = float("nan")
    msg.loss_fn_config_v2["clip"].number = float("nan")
    assert_rejected(model.client.post("/api/v1/forward_backward", **proto(msg)), "loss_fn_config", "finite",
                    status=400)
    model.runs_next_request()


# -- JSON endpoints -----------------------------------------------------------------------------------
def test_bad_json_bodies_are_400_naming_the_field(model: Model) -> None:
    post = model.client.post
    assert_rejected(post("/api/v1/optim_step", content=b"{not json", headers={"Content-Type": "application/json"}),
                    "JSON", status=400)
    assert_rejected(post("/api/v1/optim_step", json=[1, 2]), "JSON object", status=400)
    assert_rejected(post("/api/v1/optim_step", content=b"[" * 100_000, headers={"Content-Type": "application/json"}),
                    "body", "nested", status=400)
    assert_rejected(post("/api/v1/session_heartbeat", content=b'{"session_id": "\xff"}'), "JSON", status=400)
    for path in ("/api/v1/training_runs", "/api/v1/checkpoints", "/api/v1/sessions", "/v1/training_runs"):
        assert_rejected(model.client.get(path, params={"offset": 2**63}), "offset", status=400)
        assert_rejected(model.client.get(path, params={"limit": 10**9}), "limit", status=400)
    # A protobuf body sent as JSON (wrong Content-Type) is refused as JSON, not crashed on.
    assert_rejected(post("/api/v1/forward_backward",
                         content=fwdbwd_message(model.model_id, 1).SerializeToString()), "JSON", status=400)
    cases: list[tuple[dict[str, Any], tuple[str, ...]]] = [
        ({"learning_rate": "fast"}, ("adam_params.learning_rate",)),
        ({"learning_rate": -1.0}, ("adam_params.learning_rate",)),
        ({"beta1": 1.5}, ("adam_params.beta1",)),
        ({"eps": 0.0}, ("adam_params.eps",)),
        ({"grad_clip_norm": -2.0}, ("adam_params.grad_clip_norm",)),
    ]
    for params, fragments in cases:
        answer = post("/api/v1/optim_step", json={"model_id": model.model_id, "seq_id": model.take(),
                                                  "adam_params": params})
        assert_rejected(answer, *fragments, status=400)
        model.runs_next_request()
    assert_rejected(post("/api/v1/optim_step", json={"seq_id": 99, "adam_params": {}}), "model_id", status=400)
    assert_rejected(post("/api/v1/optim_step", json={"model_id": model.model_id, "seq_id": model.take(),
                                                     "optimizer_params": {"type": "dimuon", "learning_rate": 1}}),
                    "adam", status=400)
    model.runs_next_request()


def test_bad_create_model_is_4xx_naming_the_field(mallory: httpx.Client, session_id: str, base_model: str) -> None:
    def create(**body: Any) -> httpx.Response:
        return mallory.post("/api/v1/create_model", json={"session_id": session_id, "model_seq_id": 50,
                                                          "base_model": base_model, **body})

    assert_rejected(create(lora_config={"rank": 0}), "lora_config.rank", status=400)
    assert_rejected(create(lora_config={"rank": 10**6}), "rank", "maximum", status=400)
    assert_rejected(create(lora_config={"rank": 4, "train_mlp": False, "train_attn": False,
                                        "train_unembed": False}), "train_", status=400)
    assert_rejected(create(base_model="no/such-model"), "no/such-model")
    assert_rejected(create(optimizer_config={"type": "dimuon", "version": 1}), "optimizer_config", "adamw",
                    status=400)
    assert_rejected(create(model_seq_id=-1, lora_config={"rank": 4}), "model_seq_id")


def test_bad_sampling_requests_are_400(mallory: httpx.Client, session_id: str, base_model: str,
                                       limits: dict[str, int]) -> None:
    created = mallory.post("/api/v1/create_sampling_session", json={
        "session_id": session_id, "sampling_session_seq_id": 0, "base_model": base_model})
    assert created.status_code == 200, created.text
    sampler = created.json()["sampling_session_id"]

    def sample(seq_id: int, tokens: list[int], **params: Any) -> httpx.Response:
        top = {k: params.pop(k) for k in ("num_samples", "topk_prompt_logprobs", "prompt_logprobs") if k in params}
        return mallory.post("/api/v1/asample", json={
            "sampling_session_id": sampler, "seq_id": params.pop("seq_id_override", seq_id), **top,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]},
            "sampling_params": {"max_tokens": 2, **params},
        })

    vocab, context = limits["vocab"], limits["max_context"]
    assert_rejected(sample(1, [1, vocab + 3]), "prompt", "vocabulary", status=400)
    assert_rejected(sample(2, [1, 2], max_tokens=context), "max_tokens", f"context limit of {context}", status=400)
    assert_rejected(sample(3, list(range(1, 10)) * (context // 9 + 1)), "prompt", "context limit", status=400)
    assert_rejected(sample(4, [1, 2], num_samples=0), "num_samples", status=400)
    assert_rejected(sample(5, [1, 2], top_p=0.0), "top_p", status=400)
    assert_rejected(sample(6, [1, 2], temperature=-1.0), "temperature", status=400)
    assert_rejected(sample(7, [1, 2], stop=[vocab + 1]), "stop", status=400)
    assert_rejected(sample(8, []), "prompt", status=400)
    # The top-k rows are padded to k: k is bounded by the vocabulary (a huge k must not allocate).
    assert_rejected(sample(10, [1, 2], topk_prompt_logprobs=10**9, prompt_logprobs=True),
                    "topk_prompt_logprobs", f"vocabulary size {vocab}", status=400)
    assert_rejected(sample(11, [1, 2], seq_id_override=2**64), "seq_id", status=400)
    ok = sample(9, [1, 2, 3])
    assert ok.status_code == 200, ok.text
    wait_result(mallory, ok.json()["request_id"], protobuf=True)


# -- the SDK: a failed forward_backward does not block the next one -----------------------------------
def test_sdk_failed_forward_backward_does_not_block_the_model(server: Server, mallory_key: str, base_model: str,
                                                              limits: dict[str, int]) -> None:
    service = tinker.ServiceClient(base_url=server.url, api_key=mallory_key)
    training = service.create_lora_training_client(base_model=base_model, rank=4).result()
    over_context = [int(t) for t in np.arange(limits["max_context"] + 2) % 400 + 1]
    failures: list[tuple[Callable[[], Any], str]] = [
        (lambda: training.forward_backward([datum([1, 2, limits["vocab"] + 5, 3])], "cross_entropy"), "vocabulary"),
        (lambda: training.forward_backward([datum()], "bogus_loss"), "loss_fn"),  # type: ignore[arg-type]
        (lambda: training.forward_backward([datum(over_context)], "cross_entropy"), "context limit"),
        (lambda: training.forward([datum([1, 2, 10**6])], "cross_entropy"), "vocabulary"),
    ]
    try:
        for submit, fragment in failures:
            with pytest.raises(tinker.BadRequestError) as info:
                submit().result(timeout=RESULT_TIMEOUT_S)
            assert fragment in str(info.value)
            # The very next request on the same TrainingClient completes.
            out = training.forward_backward([datum()], "cross_entropy").result(timeout=RESULT_TIMEOUT_S)
            assert out.metrics["loss:sum"] > 0
            training.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=RESULT_TIMEOUT_S)
    finally:
        close_all([service])  # finishes the session: its heartbeat stops


# -- afterwards: grace never noticed, nothing was a 5xx -----------------------------------------------
def test_other_tenant_kept_training_throughout(grace: Grace) -> None:
    before = grace.steps
    assert not grace.errors, grace.errors
    deadline = time.monotonic() + RESULT_TIMEOUT_S
    while grace.steps <= before and time.monotonic() < deadline and not grace.errors:
        time.sleep(0.05)
    assert not grace.errors, grace.errors
    assert grace.steps > before and grace.steps >= 3, grace.steps
    grace.stop.set()
    assert grace.thread is not None
    grace.thread.join(timeout=RESULT_TIMEOUT_S)  # its last step finished: no call of it still in flight
    assert not grace.thread.is_alive() and not grace.errors, grace.errors
    assert grace.step() > 0  # and a step after the barrage works too


def test_nothing_was_a_5xx(server: Server) -> None:
    metrics = httpx.get(f"{server.url}/metrics", timeout=10).text
    served = re.findall(r'carpool_http_requests_total\{[^}]*status="(\d+)"\} (\d+)', metrics)
    assert served, metrics[:2000]
    assert {status for status, _ in served} & {"400", "413"}, "the barrage did not reach the server?"
    fives = [(status, n) for status, n in served if status.startswith("5") and int(n) > 0]
    assert not fives, [line for line in metrics.splitlines() if 'status="5' in line]
    log = server.log()
    assert "Traceback" not in log and "unhandled error" not in log, log[-4000:]
