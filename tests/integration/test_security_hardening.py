"""Security hardening (issue 16) through the real control plane, engine and database: the model's owner is
checked before a body is decoded, (T, K) targets are charged T x K, the seq-id gap exemption of the
concurrency quota is one request per model, storage and session quotas, the sweeper, revocation of
sampling sessions and download links, and seq ids that would overflow `next_seq_id`."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
from conftest import BASE, Harness, build_harness
from fastapi.testclient import TestClient
from tinker.proto import tinker_public_pb2 as pb

from gateway.app import create_app
from gateway.auth import DatabaseAuthenticator
from gateway.settings import GatewaySettings
from services.auth.tenants import Tenant, create_tenant_with_key
from services.control.api import CheckpointRef, Invalid, NotFound, QuotaExceeded, SaveOptions
from services.control.context import ControlOptions
from services.control.quotas import QuotaOptions
from services.control.sweeper import Sweeper, SweepOptions
from services.db import database_url_for_data_dir
from services.db.checkpoints import get_checkpoint, set_checkpoint_expiry
from services.db.columns import utcnow
from services.db.ids import ModelId, SessionId, TenantId
from services.db.sessions import get_session
from services.db.tenants import TenantQuotas
from services.domain.sampling import SampleWork, SamplingParams
from services.domain.training import Datum, ForwardBackwardWork, LoraSpec


@pytest.fixture
def h(tiny_model_dir: Path, tmp_path: Path) -> Iterator[Harness]:
    options = ControlOptions(scratch_dir=tmp_path / "scratch", sampler_recheck_s=0.0,
                             quotas=QuotaOptions(token_window_s=3600.0))
    harness = build_harness(database_url_for_data_dir(tmp_path), tiny_model_dir, tmp_path, options=options)
    yield harness
    harness.close()


def _tenant(h: Harness, name: str, **quotas: int) -> tuple[Tenant, str]:
    with h.db.sessions.begin() as db:
        tenant, key = create_tenant_with_key(db, name, quotas=TenantQuotas(**quotas))
    return tenant, key.key


def _model(h: Harness, t: Tenant, session: SessionId | None = None) -> ModelId:
    sub = h.run(h.control.create_model(t, session or h.session(t), 0, BASE, LoraSpec(rank=2, seed=1), None))
    h.done(t, sub.request_id)
    return sub.model_id


def _work(t_len: int = 5, k: int | None = None) -> ForwardBackwardWork:
    seq = np.arange(1, t_len + 2)
    target = seq[1:] if k is None else np.tile(seq[1:, None], (1, k))
    return ForwardBackwardWork(None, [Datum(seq[:-1], {"target_tokens": target})])


def _proto(model_id: str, seq_id: int, extra: dict[str, pb.Tensor]) -> bytes:
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=seq_id, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(1, 5, dtype="<i4").tobytes()
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype, target.dense = pb.DTYPE_INT64, np.arange(2, 6, dtype="<i8").tobytes()
    for name, tensor in extra.items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    return msg.SerializeToString()


def test_a_foreign_model_is_a_404_before_its_body_is_decoded(h: Harness) -> None:
    owner, _ = _tenant(h, "owner")
    _, intruder_key = _tenant(h, "intruder")
    model = _model(h, owner)
    poison = {"evil": pb.Tensor(dtype=pb.DTYPE_FLOAT32, dense=b"\0" * 4)}  # a 400 once decoded
    app = create_app(GatewaySettings(), h.control, DatabaseAuthenticator(h.db, cache_seconds=0))
    with TestClient(app) as http:
        headers = {"X-API-Key": intruder_key, "Content-Type": "application/x-protobuf"}
        foreign = http.post("/api/v1/forward_backward", content=_proto(model, 1, poison), headers=headers)
        assert foreign.status_code == 404 and foreign.json()["field"] == "model_id", foreign.text
        unknown = http.post("/api/v1/forward_backward", content=_proto("nope:train:0", 1, poison), headers=headers)
        assert unknown.status_code == 404 and unknown.json()["detail"] == foreign.json()["detail"].replace(
            model, "nope:train:0")


def test_two_d_targets_are_charged_t_times_k(h: Harness) -> None:
    tenant, _ = _tenant(h, "tpm", tokens_per_minute=20)
    model = _model(h, tenant)
    with pytest.raises(Invalid, match="40 tokens"):  # T = 5, K = 8: more than the whole minute's 20
        h.run(h.control.forward_backward(tenant, model, 1, _work(5, k=8)))
    accepted = h.run(h.control.forward_backward(tenant, model, 2, _work(5, k=2)))  # 10 tokens fit
    h.done(tenant, accepted.request_id)
    usage = h.run(h.control.usage(tenant))
    assert usage["forward_backward_tokens"] == 10


def test_a_far_seq_id_exempts_only_the_next_request_of_its_model(h: Harness) -> None:
    tenant, _ = _tenant(h, "conc", max_concurrent_requests=1)
    model = _model(h, tenant)
    h.loop.stop()  # nothing runs from here on: every accepted request stays unfinished
    h.run(h.control.forward_backward(tenant, model, 1000, _work()))  # 0 unfinished: within the limit
    h.run(h.control.forward_backward(tenant, model, 1, _work()))  # what the model waits for: exempt
    with pytest.raises(QuotaExceeded, match="limit is 1"):
        h.run(h.control.forward_backward(tenant, model, 2, _work()))  # seq 1 is still unfinished


def test_seq_ids_that_would_overflow_next_seq_id_are_refused(h: Harness) -> None:
    tenant, _ = _tenant(h, "overflow")
    model = _model(h, tenant)
    with pytest.raises(Invalid) as err:
        h.run(h.control.forward_backward(tenant, model, 2**31 - 1, _work()))
    assert err.value.field == "seq_id" and str(2**31 - 2) in err.value.message


def test_storage_and_session_quotas(h: Harness) -> None:
    tenant, _ = _tenant(h, "saver", max_checkpoints=1, max_sessions=1)
    session = h.session(tenant)
    with pytest.raises(QuotaExceeded, match="max_sessions"):
        h.session(tenant)
    model = _model(h, tenant, session)
    first = h.run(h.control.save(tenant, model, 1, "training", SaveOptions(name="a")))
    assert isinstance(h.done(tenant, first.request_id), CheckpointRef)
    with pytest.raises(Invalid) as err:
        h.run(h.control.save(tenant, model, 2, "training", SaveOptions(name="b")))
    assert err.value.field == "max_checkpoints" and "limit" in err.value.message
    again = h.run(h.control.save(tenant, model, 3, "training", SaveOptions(name="a", overwrite=True)))
    assert isinstance(h.done(tenant, again.request_id), CheckpointRef)  # replacing adds no checkpoint
    usage = h.run(h.control.usage(tenant))
    assert usage["checkpoints"] == 1 and usage["max_checkpoints"] == 1 and usage["checkpoint_bytes"] > 0


def test_the_sweeper_deletes_expired_checkpoints_and_finishes_stale_sessions(h: Harness) -> None:
    tenant, _ = _tenant(h, "ttl")
    session = h.session(tenant)
    model = _model(h, tenant, session)
    saved = h.done(tenant, h.run(h.control.save(tenant, model, 1, "training", SaveOptions(name="old"))).request_id)
    kept = h.done(tenant, h.run(h.control.save(tenant, model, 2, "training", SaveOptions(name="new"))).request_id)
    tid = TenantId(tenant.id)
    with h.db.sessions.begin() as db:
        old_row = get_checkpoint(db, tid, saved.tinker_path)
        assert old_row is not None
        files = h.store.local_path(old_row.storage_uri)
        assert files.is_dir()
        set_checkpoint_expiry(db, tid, saved.tinker_path, utcnow() - timedelta(seconds=1))
    report = Sweeper(h.db, h.store, SweepOptions(stale_session_s=3600)).sweep_once()
    assert report.checkpoints_deleted == 1 and report.files_failed == 0 and report.sessions_finished == 0
    with h.db.sessions.begin() as db:
        assert get_checkpoint(db, tid, saved.tinker_path) is None
        assert get_checkpoint(db, tid, kept.tinker_path) is not None
    assert not files.exists()
    assert Sweeper(h.db, h.store, SweepOptions(stale_session_s=0.0)).sweep_once().sessions_finished == 1
    with h.db.sessions.begin() as db:
        row = get_session(db, tid, session)
        assert row is not None and row.finished_at is not None


def test_unpublishing_or_replacing_a_checkpoint_revokes_other_tenants_samplers(h: Harness) -> None:
    owner, _ = _tenant(h, "publisher")
    reader, _ = _tenant(h, "reader")
    model = _model(h, owner)
    ref = h.done(owner, h.run(h.control.save(owner, model, 1, "sampler", SaveOptions(name="pub"))).request_id)
    h.run(h.control.set_checkpoint_public(owner, ref.tinker_path, True))
    sampler = h.run(h.control.create_sampling_session(reader, h.session(reader), 0, model_path=ref.tinker_path,
                                                      base_model=None))
    work = SampleWork(None, np.array([5, 17, 42]), params=SamplingParams(max_tokens=2, temperature=0.0))
    h.done(reader, h.run(h.control.sample(reader, sampler, 0, work)).request_id)
    h.run(h.control.set_checkpoint_public(owner, ref.tinker_path, False))
    with pytest.raises(NotFound, match="unpublished"):
        h.run(h.control.sample(reader, sampler, 1, work))
    h.run(h.control.set_checkpoint_public(owner, ref.tinker_path, True))
    h.done(reader, h.run(h.control.sample(reader, sampler, 2, work)).request_id)  # readable again
    h.run(h.control.delete_checkpoint(owner, ref.tinker_path))
    again = h.done(owner, h.run(h.control.save(owner, model, 2, "sampler", SaveOptions(name="pub"))).request_id)
    h.run(h.control.set_checkpoint_public(owner, again.tinker_path, True))
    with pytest.raises(NotFound, match="replaced"):  # same path, new contents: not what the session bound
        h.run(h.control.sample(reader, sampler, 3, work))


def test_download_links_die_with_their_checkpoint_version(h: Harness) -> None:
    tenant, _ = _tenant(h, "exporter")
    model = _model(h, tenant)
    ref = h.done(tenant, h.run(h.control.save(tenant, model, 1, "external", SaveOptions(name="x"))).request_id)
    urls = h.run(h.control.external_weights_urls(tenant, ref.tinker_path, "http://carpool.test")).urls
    token = next(iter(urls.values())).rsplit("/", 1)[1]
    assert h.run(h.control.open_signed_file(token)).is_file()
    h.run(h.control.delete_checkpoint(tenant, ref.tinker_path))
    h.done(tenant, h.run(h.control.save(tenant, model, 2, "external", SaveOptions(name="x"))).request_id)
    with pytest.raises(NotFound, match="deleted or replaced"):
        h.run(h.control.open_signed_file(token))  # the path holds a new export: the old link is dead
