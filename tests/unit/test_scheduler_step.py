"""`Scheduler.step()` end to end: ordering, packing, barriers, rejections, completion, stats."""

from __future__ import annotations

from collections import defaultdict

from services.domain.training import WorkError
from services.scheduler import (
    BarrierPlan,
    ModelId,
    PassPlan,
    QueuedRequest,
    RequestId,
    RequestKind,
    Scheduler,
    SchedulerLimits,
    StepPlan,
    TenantId,
)

FB, FWD, OPTIM, SAVE, SAMPLE = (
    RequestKind.FORWARD_BACKWARD,
    RequestKind.FORWARD,
    RequestKind.OPTIM_STEP,
    RequestKind.SAVE,
    RequestKind.SAMPLE,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Client:
    """Builds requests the way the SDK numbers them: per model, seq 1, 2, 3... after create."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.next_seq: dict[str, int] = defaultdict(lambda: 1)

    def make(
        self, model: str, kind: RequestKind = FB, tokens: int = 10, *, tenant: str | None = None
    ) -> QueuedRequest:
        seq = self.next_seq[model]
        self.next_seq[model] += 1
        return self.at(model, seq, kind, tokens, tenant=tenant)

    def at(
        self,
        model: str,
        seq: int | None,
        kind: RequestKind = FB,
        tokens: int = 10,
        *,
        tenant: str | None = None,
    ) -> QueuedRequest:
        return QueuedRequest(
            request_id=RequestId(f"{model}#{seq}" if kind is not SAMPLE else f"{model}~{seq}"),
            tenant_id=TenantId(tenant or model.split("-")[0]),
            model_id=ModelId(model),
            kind=kind,
            seq_id=seq,
            num_tokens=tokens,
            enqueued_at=self.clock(),
        )


def make_scheduler(**limits: int) -> tuple[Scheduler, Client, FakeClock]:
    clock = FakeClock()
    scheduler = Scheduler(SchedulerLimits(**limits), clock=clock)
    for model in ("a-1", "a-2", "b-1", "c-1"):
        scheduler.open_model(ModelId(model), next_seq_id=1)
    return scheduler, Client(clock), clock


def ids(requests: tuple[QueuedRequest, ...] | list[QueuedRequest]) -> list[str]:
    return [r.request_id for r in requests]


def finish(scheduler: Scheduler, plan: StepPlan) -> None:
    for item in plan.items:
        scheduler.complete(item, ["ok"] * len(item.requests))


def test_chunks_sent_out_of_order_run_in_seq_order_in_one_pass() -> None:
    scheduler, client, _ = make_scheduler()
    chunks = [client.make("a-1") for _ in range(4)]
    for chunk in chunks[1:]:
        scheduler.submit(chunk)
    assert scheduler.step().is_empty
    scheduler.submit(chunks[0])
    plan = scheduler.step()
    assert len(plan.passes) == 1
    assert ids(plan.passes[0].requests) == ["a-1#1", "a-1#2", "a-1#3", "a-1#4"]


def test_duplicate_submission_returns_the_first_request_id_and_runs_once() -> None:
    scheduler, client, _ = make_scheduler()
    first = client.at("a-1", 1)
    retry = QueuedRequest(RequestId("other"), first.tenant_id, first.model_id, FB, 1, 10)
    assert scheduler.submit(first)[:2] == (first.request_id, True)
    admission = scheduler.submit(retry)
    assert (admission.request_id, admission.is_new) == (first.request_id, False)
    plan = scheduler.step()
    assert ids(plan.passes[0].requests) == ["a-1#1"]


def test_seq_id_rejected_at_the_edge_does_not_block_the_model() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.at("a-1", 2))
    scheduler.mark_consumed(ModelId("a-1"), 1)
    assert ids(scheduler.step().passes[0].requests) == ["a-1#2"]


def test_pass_packs_many_tenants_under_the_token_budget_grouped_by_model() -> None:
    scheduler, client, _ = make_scheduler(max_tokens_per_pass=100, quantum_tokens=10)
    for model in ("a-1", "b-1", "c-1", "a-2"):
        scheduler.submit(client.make(model, tokens=30))
        scheduler.submit(client.make(model, tokens=10))
    plan = scheduler.step()
    (packed,) = plan.passes
    assert packed.num_tokens <= 100
    assert len(packed.tenants) == 3
    models = [r.model_id for r in packed.requests]
    assert models == [m for seg in packed.segments for m in [seg.model_id] * len(seg.requests)]
    assert len(set(packed.model_ids)) == len(packed.model_ids)
    for segment in packed.segments:
        assert [r.seq_id for r in segment.requests] == sorted(r.seq_id or 0 for r in segment.requests)


def test_adapter_limit_caps_models_per_pass() -> None:
    scheduler, client, _ = make_scheduler(max_adapters_per_pass=2)
    for model in ("a-1", "a-2", "b-1", "c-1"):
        scheduler.submit(client.make(model))
    first = scheduler.step().passes[0]
    assert len(first.model_ids) == 2
    second = scheduler.step().passes[0]  # passes of other models need not wait for the first
    assert set(first.model_ids).isdisjoint(second.model_ids)


def test_forward_and_forward_backward_of_one_model_share_a_pass_up_to_its_barrier() -> None:
    scheduler, client, _ = make_scheduler()
    for kind in (FWD, FB, FWD, OPTIM, FB):
        scheduler.submit(client.make("a-1", kind))
    plan = scheduler.step()
    assert [r.kind for r in plan.passes[0].requests] == [FWD, FB, FWD]
    assert plan.barriers == ()
    # The barrier waits for the pass to complete, and nothing after it is planned meanwhile.
    assert scheduler.step().is_empty
    finish(scheduler, plan)
    plan = scheduler.step()
    assert [b.request.kind for b in plan.barriers] == [OPTIM]
    assert plan.passes == ()
    finish(scheduler, plan)
    assert ids(scheduler.step().passes[0].requests) == ["a-1#5"]


def test_barrier_of_one_model_does_not_block_another() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.make("a-1", OPTIM))
    scheduler.submit(client.make("b-1", FB))
    plan = scheduler.step()
    assert [b.request.model_id for b in plan.barriers] == ["a-1"]
    assert ids(plan.passes[0].requests) == ["b-1#1"]
    # While a-1's barrier runs, b-1 keeps going.
    scheduler.submit(client.make("a-1", FB))
    scheduler.submit(client.make("b-1", FB))
    plan2 = scheduler.step()
    assert ids(plan2.passes[0].requests) == ["b-1#2"]


def test_barriers_of_different_models_go_in_the_same_step() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.make("a-1", OPTIM))
    scheduler.submit(client.make("b-1", SAVE))
    plan = scheduler.step()
    assert sorted(b.request.model_id for b in plan.barriers) == ["a-1", "b-1"]


def test_passes_of_one_model_pipeline_but_its_barrier_waits_for_all_of_them() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.make("a-1"))
    first = scheduler.step()
    scheduler.submit(client.make("a-1"))
    scheduler.submit(client.make("a-1", OPTIM))
    second = scheduler.step()
    assert ids(second.passes[0].requests) == ["a-1#2"]
    finish(scheduler, first)
    assert scheduler.step().barriers == ()
    finish(scheduler, second)
    assert ids(scheduler.step().barriers[0].requests) == ["a-1#3"]


def test_oversized_request_gets_an_error_result_and_the_model_moves_on() -> None:
    scheduler, client, _ = make_scheduler(max_tokens_per_pass=100)
    big, after = client.make("a-1", tokens=101), client.make("a-1", tokens=50)
    scheduler.submit(after)
    assert scheduler.submit(big).request_id == big.request_id
    plan = scheduler.step()
    (rejected,) = plan.rejected
    assert rejected.request is big and isinstance(rejected.result, WorkError)
    assert rejected.result.category == "user" and "101 tokens" in rejected.result.message
    assert ids(plan.passes[0].requests) == ["a-1#2"]
    assert scheduler.submit(client.at("a-1", 1, tokens=101)).is_new is False


def test_malformed_and_stale_requests_are_rejected_not_raised() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.at("a-1", None))
    scheduler.submit(client.at("b-1", 0))  # b-1 was opened at seq 1: seq 0 is behind it
    plan = scheduler.step()
    assert len(plan.rejected) == 2 and all(c.is_error for c in plan.rejected)
    assert scheduler.stats().requests_rejected == 2


def test_samples_are_deduped_and_batched_round_robin_across_tenants() -> None:
    scheduler, client, _ = make_scheduler(max_sample_batch=3)
    for i in range(4):
        scheduler.submit(client.at("a-s", i, SAMPLE))
    scheduler.submit(client.at("b-s", 0, SAMPLE))
    assert scheduler.submit(client.at("b-s", 0, SAMPLE)).is_new is False
    plan = scheduler.step()
    assert ids(plan.sample_batches[0].requests) == ["a-s~0", "b-s~0", "a-s~1"]
    assert ids(scheduler.step().sample_batches[0].requests) == ["a-s~2", "a-s~3"]


def test_complete_pairs_results_and_fills_gaps_with_server_errors() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.make("a-1"))
    scheduler.submit(client.make("a-1"))
    (item,) = scheduler.step().items
    completions = scheduler.complete(item, ["r1"])
    assert [c.result for c in completions][0] == "r1"
    assert isinstance(completions[1].result, WorkError) and completions[1].result.category == "server"
    assert scheduler.complete(item, ["again"]) == []


def test_a_failed_backend_call_fails_every_request_of_the_item() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.make("a-1"))
    scheduler.submit(client.make("b-1"))
    (item,) = scheduler.step().items
    error = WorkError("CUDA out of memory", "server")
    assert [c.result for c in scheduler.complete(item, error)] == [error, error]


def test_close_model_fails_its_queued_requests() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.make("a-1"))
    scheduler.submit(client.at("a-1", 3))
    closed = scheduler.close_model(ModelId("a-1"))
    assert ids([c.request for c in closed]) == ["a-1#1", "a-1#3"] and all(c.is_error for c in closed)
    assert scheduler.step().is_empty


def test_stats_report_depths_waits_and_pass_shapes() -> None:
    scheduler, client, clock = make_scheduler(max_tokens_per_pass=20)
    scheduler.submit(client.make("a-1"))
    scheduler.submit(client.make("b-1"))
    scheduler.submit(client.make("c-1", tokens=20))
    scheduler.submit(client.at("a-2", 5))
    scheduler.submit(client.at("b-s", 0, SAMPLE))
    clock.now += 7
    before = scheduler.stats()
    assert before.out_of_order_waiting == 1 and before.samples_queued == 1
    assert before.queued_by_tenant == {"a": 2, "b": 2, "c": 1}
    assert before.queued_by_model == {"a-1": 1, "a-2": 1, "b-1": 1, "c-1": 1}
    assert before.oldest_wait_s == 7
    plan = scheduler.step()
    stats = scheduler.stats()
    assert stats.passes_planned == 1 and stats.sample_batches_planned == 1
    assert stats.tenants_in_last_pass == len(plan.passes[0].tenants) == 2
    assert stats.in_flight_items == 2
    assert stats.queued_by_model == {"c-1": 1, "a-2": 1}
    assert stats.mean_tenants_per_pass == 2.0


def test_light_tenant_waits_a_bounded_number_of_passes_beside_a_tenant_with_ten_times_the_tokens() -> None:
    """Every other tick the heavy tenant adds 10x the light one's tokens (more than fits); a pass a tick."""
    scheduler, client, clock = make_scheduler(max_tokens_per_pass=1024, quantum_tokens=256)
    for model in ["light-1", *(f"heavy-{i}" for i in range(5))]:
        scheduler.open_model(ModelId(model), next_seq_id=1)
    submitted_at_pass: dict[str, int] = {}
    passes_waited: list[int] = []
    served: dict[str, int] = defaultdict(int)
    for tick in range(200):
        clock.now += 1
        if tick % 2 == 0:
            for i in range(5):
                scheduler.submit(client.make(f"heavy-{i}", tokens=400))
            light = client.make("light-1", tokens=200)
            scheduler.submit(light)
            submitted_at_pass[light.request_id] = scheduler.stats().passes_planned
        plan = scheduler.step()
        passes_so_far = scheduler.stats().passes_planned
        for request in (r for packed in plan.passes for r in packed.requests):
            served[request.tenant_id] += request.num_tokens
            if request.tenant_id == "light":
                passes_waited.append(passes_so_far - submitted_at_pass.pop(request.request_id))
        finish(scheduler, plan)
    assert not submitted_at_pass
    assert max(passes_waited) == 1  # always in the very next pass
    assert served["heavy"] > 5 * served["light"]  # the heavy tenant still fills the spare capacity
    assert scheduler.stats().queued_by_tenant["heavy"] > 0  # ...and stays backlogged throughout


def test_barrier_plans_and_passes_are_the_only_item_kinds_for_training() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.make("a-1"))
    scheduler.submit(client.make("b-1", OPTIM))
    plan = scheduler.step()
    assert all(isinstance(i, PassPlan | BarrierPlan) for i in plan.items)
    assert len({i.item_id for i in plan.items}) == 2


def test_consumed_marker_from_the_queue_unblocks_the_model_and_dedupes_retries() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.at("a-1", 2))
    marker = client.at("a-1", 1, RequestKind.CONSUMED)
    assert scheduler.submit(marker)[:2] == (marker.request_id, True)
    plan = scheduler.step()
    assert ids(plan.passes[0].requests) == ["a-1#2"] and plan.rejected == ()
    assert scheduler.submit(client.at("a-1", 1))[:2] == (marker.request_id, False)
    assert scheduler.submit(client.at("a-1", 2, RequestKind.CONSUMED))[:2] == ("a-1#2", False)


def test_has_queued_counts_runnable_work_but_not_early_arrivals() -> None:
    scheduler, client, _ = make_scheduler()
    scheduler.submit(client.at("a-1", 2))
    assert not scheduler.has_queued()
    scheduler.submit(client.at("a-1", 1))
    assert scheduler.has_queued()
    plan = scheduler.step()
    assert not scheduler.has_queued()
    finish(scheduler, plan)
    assert scheduler.stats().in_flight_items == 0


def test_completing_an_item_of_another_scheduler_changes_nothing() -> None:
    scheduler, client, _ = make_scheduler()
    other, other_client, _ = make_scheduler()
    scheduler.submit(client.make("a-1"))
    other.submit(other_client.make("a-1"))
    (mine,) = scheduler.step().items
    (theirs,) = other.step().items
    assert mine.item_id == theirs.item_id
    assert scheduler.complete(theirs, ["x"]) == []
    assert scheduler.stats().in_flight_items == 1
