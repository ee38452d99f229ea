"""Security limits that need no service core (issue 16): loss-input budgets before densifying, unknown loss
keys, T x K billing, one tenant's failure confined to its request in a packed pass, the non-executable
queue codec, planted spill files, per-caller edge limits and body caps, size caps on metadata / tags /
stop strings / checkpoint names, the Redis trust check and version-bound download tokens."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from deploy.cluster_wiring import check_redis_trust, redacted_url
from deploy.embedded import StartupError
from gateway.app import create_app
from gateway.edge_limits import Caller, EdgeLimiter, EdgeLimitOptions
from gateway.settings import GatewaySettings
from services.auth.tenants import Tenant
from services.db.ids import TenantId
from services.db.tenants import TenantQuotas
from services.domain.backend import BaseModelInfo
from services.domain.training import (
    AdapterId,
    Datum,
    DatumOutput,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
    WorkError,
)
from services.jobqueue import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue
from services.jobqueue.codec import CodecError, decode, decode_request, encode_request
from services.runtime import CreateAdapter, ForwardBackward, LoopConfig, SchedulerLoop
from services.scheduler import QueuedRequest, RequestId, RequestKind
from services.scheduler.requests import ModelId
from services.scheduler.requests import TenantId as QueueTenantId
from services.storage.signing import MAX_TOKEN_TTL_S, UrlSigner, token_version
from services.wire import WireError, parse_request
from services.wire.control import CreateSessionRequest
from services.wire.convert import decode_forward_backward_body
from services.wire.requests import CreateModelRequest, SampleRequest, SaveWeightsRequest
from services.wire.sampling import sample_work

PROTO = "application/x-protobuf"


def _datum(tokens: int, inputs: dict[str, pb.Tensor]) -> pb.Datum:
    datum = pb.Datum()
    datum.model_input.add().encoded_text.tokens = np.arange(tokens, dtype="<i4").tobytes()
    for name, tensor in inputs.items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return datum


def _sparse(shape: tuple[int, int], dtype: int = pb.DTYPE_INT64) -> pb.Tensor:
    """A CSR tensor claiming `shape` with one stored value: a few bytes on the wire."""
    tensor = pb.Tensor(dtype=dtype, shape=list(shape))
    tensor.sparse_csr.values = np.ones(1, "<i8" if dtype == pb.DTYPE_INT64 else "<f4").tobytes()
    crow = np.ones(shape[0] + 1, "<i8")
    crow[0] = 0
    tensor.sparse_csr.crow_indices = crow.tobytes()
    tensor.sparse_csr.col_indices = np.zeros(1, "<i8").tobytes()
    return tensor


def _dense(arr: np.ndarray) -> pb.Tensor:
    dtype = pb.DTYPE_INT64 if arr.dtype == np.int64 else pb.DTYPE_FLOAT32
    return pb.Tensor(dtype=dtype, shape=list(arr.shape), dense=np.ascontiguousarray(arr).tobytes())


def _body(*data: pb.Datum, loss_fn: str = "cross_entropy") -> bytes:
    msg = pb.ForwardBackwardRequest(model_id="m", seq_id=3, loss_fn=loss_fn)
    msg.data.extend(data)
    return msg.SerializeToString()


# -- loss-input bombs ---------------------------------------------------------------------------------
def test_sparse_tensors_over_the_request_budget_are_refused_before_densifying() -> None:
    # Each tensor (2**23 cells, K = 64) is within the per-tensor and K caps; three of them are 1.5x the request's.
    bomb = _body(*[_datum(4, {"target_tokens": _sparse((1 << 17, 64))}) for _ in range(3)])
    assert len(bomb) < 4_000_000  # 200 MB once densified
    with pytest.raises(WireError) as err:
        decode_forward_backward_body(bomb, PROTO)
    assert err.value.field == "data[2].loss_fn_inputs.target_tokens.shape"
    assert "per request" in err.value.message and str(1 << 24) in err.value.message
    assert (err.value.model_id, err.value.seq_id) == ("m", 3)


def test_k_of_a_two_d_target_is_capped() -> None:
    target = np.zeros((4, 65), np.int64)
    with pytest.raises(WireError) as err:
        decode_forward_backward_body(_body(_datum(4, {"target_tokens": _dense(target)})), PROTO)
    assert err.value.field == "data[0].loss_fn_inputs.target_tokens.shape" and "64" in err.value.message


def test_unknown_loss_inputs_are_refused_and_unread_ones_never_densified() -> None:
    target = _dense(np.arange(1, 5, dtype=np.int64))
    with pytest.raises(WireError) as err:
        decode_forward_backward_body(_body(_datum(4, {"target_tokens": target, "evil": _sparse((8, 8))})), PROTO)
    assert err.value.field == "data[0].loss_fn_inputs.evil" and "unknown" in err.value.message
    # `mask` is a known key cross_entropy does not read: its 2**40-cell claim is skipped, not allocated.
    call = decode_forward_backward_body(
        _body(_datum(4, {"target_tokens": target, "mask": _sparse((1 << 20, 1 << 20), pb.DTYPE_FLOAT32)})), PROTO)
    assert set(call.data[0].loss_fn_inputs) == {"target_tokens"}


def test_a_two_d_target_is_billed_t_times_k() -> None:
    work = ForwardBackwardWork(AdapterId("a"), [Datum(np.arange(3), {"target_tokens": np.zeros((3, 4), np.int64)}),
                                                Datum(np.arange(5), {"target_tokens": np.zeros(5, np.int64)})])
    assert (work.num_tokens, work.billed_tokens) == (8, 3 * 4 + 5)


# -- a failing tenant in a packed pass -------------------------------------------------------------------
class ExplodingBackend:
    """Runs passes like an engine would, except that any pass holding a poisoned adapter raises."""

    def __init__(self, poisoned: AdapterId) -> None:
        self.poisoned = poisoned
        self.passes: list[list[AdapterId | None]] = []
        self.adapters: set[AdapterId] = set()

    @property
    def info(self) -> BaseModelInfo:
        return BaseModelInfo("fake", "fake", 512, 128, None, (0,))

    def create_adapter(self, adapter_id: AdapterId, spec: LoraSpec) -> None:
        self.adapters.add(adapter_id)

    def has_adapter(self, adapter_id: AdapterId) -> bool:
        return adapter_id in self.adapters

    def forward_backward(self, works: Sequence[ForwardBackwardWork]) -> list[ForwardBackwardResult | WorkError]:
        self.passes.append([w.adapter_id for w in works])
        if any(w.adapter_id == self.poisoned for w in works):
            raise MemoryError("out of memory gathering a (T, K) target")
        return [ForwardBackwardResult([DatumOutput(np.zeros(d.length), np.zeros(d.length)) for d in w.data],
                                      {"loss:sum": 1.0}) for w in works]


def test_one_tenants_failure_in_a_packed_pass_fails_only_its_request() -> None:
    backend = ExplodingBackend(AdapterId("bad"))
    queue, results = InMemoryWorkQueue(), InMemoryResultStore()
    loop = SchedulerLoop("fake", backend, queue, results, InMemoryNotifier(), config=LoopConfig(batch_window_s=0.0))
    seq = np.arange(5)
    for n, (tenant, model) in enumerate((("t1", "good"), ("t2", "bad"), ("t3", "fine"))):
        create = CreateAdapter(ModelId(model), AdapterId(model), LoraSpec(rank=2))
        queue.enqueue("fake", QueuedRequest(RequestId(f"c{n}"), QueueTenantId(tenant), ModelId(model),
                                            RequestKind.CREATE, 0, 0, time.monotonic(), create))
    loop.run_once()
    for tenant, model in (("t1", "good"), ("t2", "bad"), ("t3", "fine")):
        work = ForwardBackwardWork(AdapterId(model), [Datum(seq[:-1], {"target_tokens": seq[1:]})])
        queue.enqueue("fake", QueuedRequest(RequestId(f"fb-{model}"), QueueTenantId(tenant), ModelId(model),
                                            RequestKind.FORWARD_BACKWARD, 1, 4, time.monotonic(),
                                            ForwardBackward(work)))
    loop.run_once()
    assert backend.passes[0] == ["good", "bad", "fine"]  # one packed pass first
    outcome = {m: results.get_nowait(RequestId(f"fb-{m}")) for m in ("good", "bad", "fine")}
    assert isinstance(outcome["good"].value, ForwardBackwardResult)  # type: ignore[union-attr]
    assert isinstance(outcome["fine"].value, ForwardBackwardResult)  # type: ignore[union-attr]
    failed = outcome["bad"].value  # type: ignore[union-attr]
    assert isinstance(failed, WorkError) and failed.category == "server" and "MemoryError" in failed.message


# -- the queue codec ----------------------------------------------------------------------------------
class _Planted:
    """What an attacker with write access to Redis would store: a pickle that runs a call when loaded."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.target),))


def test_the_queue_codec_never_runs_code_from_the_bytes(tmp_path: Path) -> None:
    target = tmp_path / "pwned"
    for tag in (b"pickle5", b"cpmsgpack1"):
        with pytest.raises(CodecError):
            decode_request(tag + b":" + pickle.dumps(_Planted(target), protocol=5))
    # A well-formed msgpack blob naming a callable outside our own types is refused too.
    object_ext = msgpack.ExtType(4, msgpack.packb(["os:mkdir", {"path": str(target)}]))
    with pytest.raises(CodecError, match="outside the services package"):
        decode(b"cpmsgpack1:" + msgpack.packb(object_ext), object)
    assert not target.exists()


def test_the_codec_round_trips_requests_with_arrays() -> None:
    work = ForwardBackwardWork(AdapterId("a"), [Datum(np.arange(4), {"target_tokens": np.arange(8).reshape(4, 2),
                                                                     "weights": np.ones((4, 2), np.float32)})])
    request = QueuedRequest(RequestId("r"), QueueTenantId("t"), ModelId("m"), RequestKind.FORWARD_BACKWARD, 7, 4,
                            1.5, ForwardBackward(work))
    back = decode_request(encode_request(request))
    assert (back.request_id, back.kind, back.seq_id) == ("r", RequestKind.FORWARD_BACKWARD, 7)
    assert isinstance(back.payload, ForwardBackward)
    datum = back.payload.work.data[0]
    np.testing.assert_array_equal(datum.loss_inputs["target_tokens"], np.arange(8).reshape(4, 2))
    assert datum.loss_inputs["weights"].dtype == np.float32


def test_a_planted_spill_file_does_not_run_code(tmp_path: Path) -> None:
    from tests.unit.test_residency import _state
    from worker.engine.residency import AdapterSlots, SpillFileCorrupt

    slots = AdapterSlots(torch.device("cpu"), max_resident=1, spill_dir=tmp_path)
    slots._spill_to_disk = True
    slots.put(_state("victim", 1))
    slots.put(_state("other", 2))  # spills `victim` to disk
    # Spilled adapters live in one anonymous file: the spill directory has no name to plant a file under.
    assert list(tmp_path.iterdir()) == []
    store_file = slots._store._file
    assert store_file is not None
    # Someone who can write the file itself (through the open descriptor) gets numbers read, never code
    # run: nothing in it is ever unpickled ...
    target = tmp_path / "pwned"
    planted = io.BytesIO()
    torch.save({"state": _Planted(target)}, planted)
    os.pwrite(store_file.fileno(), planted.getvalue(), 0)
    victim = slots.get(AdapterId("victim"))  # spills `other`
    assert not target.exists() and all(p.dtype == torch.float32 for p in victim.params.values())
    # ... and bytes that cannot be read back whole (a truncated file) are refused.
    os.ftruncate(store_file.fileno(), 0)
    with pytest.raises(SpillFileCorrupt):
        slots.get(AdapterId("other"))
    assert not target.exists()


# -- the HTTP edge ------------------------------------------------------------------------------------
KEY = "tml-" + "k" * 43
TENANT = Tenant(TenantId("t-1"), "acme", False, TenantQuotas())


class OneKey:
    async def authenticate(self, api_key: str) -> Tenant | None:
        return TENANT if api_key == KEY else None


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_edge_limiter_counts_in_flight_and_rate_per_key() -> None:
    clock = Clock()
    limiter = EdgeLimiter(EdgeLimitOptions(max_in_flight=2, rate_per_s=1.0, burst=3), clock=clock)
    caller = Caller("key:abc", "10.0.0.1", "abc")
    assert limiter.admit(caller) is None and limiter.admit(caller) is None
    refused = limiter.admit(caller)
    assert refused is not None and "edge_max_in_flight" in refused.detail
    limiter.release(caller, 200)
    assert limiter.admit(caller) is None  # the third token of the burst
    limiter.release(caller, 200)
    limiter.release(caller, 200)
    refused = limiter.admit(caller)
    assert refused is not None and "edge_rate_per_second" in refused.detail
    assert refused.retry_after_s == pytest.approx(1.0)
    assert limiter.admit(Caller("key:other", "10.0.0.1", "other")) is None  # other keys are not held up
    clock.now += 1.0
    assert limiter.admit(caller) is None


def test_failed_authentication_is_rate_limited_per_address_but_proven_keys_pass() -> None:
    clock = Clock()
    limiter = EdgeLimiter(EdgeLimitOptions(failed_auth_per_minute=6, failed_auth_burst=2), clock=clock)
    good = Caller("key:good", "10.0.0.9", "good")
    assert limiter.admit(good) is None
    limiter.release(good, 200)
    for n in range(2):
        guess = Caller(f"key:guess{n}", "10.0.0.9", f"guess{n}")
        assert limiter.admit(guess) is None
        limiter.release(guess, 401)
    refused = limiter.admit(Caller("key:guess3", "10.0.0.9", "guess3"))
    assert refused is not None and "failed authentications" in refused.detail and refused.retry_after_s > 0
    assert limiter.admit(good) is None  # a key that authenticated stays usable from that address
    clock.now += refused.retry_after_s
    assert limiter.admit(Caller("key:guess4", "10.0.0.9", "guess4")) is None


def test_small_routes_get_the_small_body_cap_and_429_carries_retry_after() -> None:
    settings = GatewaySettings(max_small_body_bytes=4096, edge_rate_per_second=1.0, edge_rate_burst=2)
    with TestClient(create_app(settings, object(), OneKey()), raise_server_exceptions=False) as http:  # type: ignore[arg-type]
        big = b"{" + b" " * 8192 + b"}"
        headers = {"X-API-Key": KEY, "Content-Type": "application/json"}
        response = http.post("/api/v1/create_session", content=big, headers=headers)
        assert response.status_code == 413 and "4096" in response.json()["detail"]
        response = http.post("/api/v1/forward_backward", content=big, headers=headers)
        assert response.status_code != 413  # the bulk route keeps max_body_bytes
        response = http.post("/api/v1/create_session", content=b"{}", headers=headers)
        assert response.status_code == 429 and int(response.headers["Retry-After"]) >= 1
        assert "retry-after-ms" in response.headers


# -- request field caps -----------------------------------------------------------------------------
def test_metadata_tags_stop_strings_and_name_bytes_are_capped() -> None:
    many = {f"k{i}": "v" for i in range(65)}
    for model, body, field in [
        (CreateModelRequest, {"session_id": "s", "model_seq_id": 0, "base_model": "b", "user_metadata": many},
         "user_metadata"),
        (CreateSessionRequest, {"tags": ["t"] * 65}, "tags"),
        (CreateSessionRequest, {"user_metadata": {"k": "x" * 20_000}}, "user_metadata"),
        (SaveWeightsRequest, {"model_id": "m", "path": "é" * 101, "seq_id": 1}, "path"),
    ]:
        with pytest.raises(WireError) as err:
            parse_request(model, json.dumps(body).encode())
        assert err.value.field.startswith(field), (err.value.field, field)
    body = {"sampling_session_id": "s", "num_samples": 1, "seq_id": 1,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": [1, 2]}]},
            "sampling_params": {"max_tokens": 4, "stop": ["a" * 257]}}
    with pytest.raises(WireError) as err:
        sample_work(parse_request(SampleRequest, json.dumps(body).encode()))
    assert err.value.field.startswith("sampling_params.stop")


# -- cluster trust and download tokens --------------------------------------------------------------
def test_cluster_mode_refuses_a_redis_without_password_or_tls() -> None:
    with pytest.raises(StartupError, match="CARPOOL_ALLOW_INSECURE_REDIS"):
        check_redis_trust("redis://10.0.0.5:6379/0", allow_insecure=False)
    check_redis_trust("redis://:s3cret@10.0.0.5:6379/0", allow_insecure=False)
    check_redis_trust("rediss://10.0.0.5:6380/0", allow_insecure=False)
    check_redis_trust("redis://10.0.0.5:6379/0", allow_insecure=True)
    assert "s3cret" not in redacted_url("redis://user:s3cret@10.0.0.5:6379/0")


def test_download_tokens_carry_the_checkpoint_version_and_a_bounded_lifetime() -> None:
    signer = UrlSigner(b"0123456789abcdef0123456789abcdef")
    soon = datetime.now(UTC) + timedelta(hours=1)
    token = signer.sign("t/run/external/x/adapter.bin", soon, version="17")
    assert signer.verify(token) == "t/run/external/x/adapter.bin" and token_version(token) == "17"
    assert token_version(signer.sign("p", soon)) is None
    with pytest.raises(ValueError, match="at most"):
        signer.sign("p", datetime.now(UTC) + timedelta(seconds=MAX_TOKEN_TTL_S + 60))


def test_client_telemetry_is_logged_capped(caplog: pytest.LogCaptureFixture) -> None:
    event = {"event": "UNHANDLED_EXCEPTION", "event_id": "e", "event_session_index": 1, "severity": "ERROR",
             "timestamp": "2026-01-01T00:00:00Z", "error_type": "E" * 2000, "error_message": "x" * 15_000}
    body = {"events": [event] * 30, "platform": "linux", "sdk_version": "0.38.0", "session_id": "s",
            "process_uuid": "p"}
    app = create_app(GatewaySettings(), object(), OneKey())  # type: ignore[arg-type]
    with TestClient(app) as http, caplog.at_level(logging.INFO, logger="gateway.routes.service"):
        response = http.post("/api/v1/telemetry", json=body, headers={"X-API-Key": KEY})
    assert response.status_code == 200, response.text
    logged = [r.getMessage() for r in caplog.records if "client telemetry" in r.getMessage()]
    assert len(logged) == 10 and max(len(m) for m in logged) < 1000
