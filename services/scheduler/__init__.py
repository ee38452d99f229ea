"""Per-base-model scheduler: orders each model's requests by seq_id and packs many tenants into one pass.

`Scheduler.step()` is the whole story (see `scheduler.py`); the rest are its parts:
`requests` (what is queued, what a step plans, what comes back), `ordering` (per-model seq_id
sequencer), `policy` (packing + fairness), `pacing` (pass cost and contended budgets), `arrivals` (when
active tenants are due, and holding an item for them), `simulation` (the scheduler on a simulated clock and
engine, for tests and `bench/gpu_sim.py`).
"""

from services.scheduler.ordering import Sequencer, StaleSeqIdError, UnorderedDedupe
from services.scheduler.pacing import PassCostModel, PassPacer
from services.scheduler.policy import FairPacker, SchedulerLimits, pick_sample_batch
from services.scheduler.requests import (
    Admission,
    BarrierPlan,
    Completion,
    ModelId,
    PassPlan,
    PassSegment,
    PlanItem,
    PlanItemId,
    QueuedRequest,
    RequestId,
    RequestKind,
    SampleBatchPlan,
    SchedulerStats,
    StepPlan,
    TenantId,
)
from services.scheduler.scheduler import Scheduler

__all__ = [
    "Admission",
    "BarrierPlan",
    "Completion",
    "FairPacker",
    "ModelId",
    "PassCostModel",
    "PassPacer",
    "PassPlan",
    "PassSegment",
    "PlanItem",
    "PlanItemId",
    "QueuedRequest",
    "RequestId",
    "RequestKind",
    "SampleBatchPlan",
    "Scheduler",
    "SchedulerLimits",
    "SchedulerStats",
    "Sequencer",
    "StaleSeqIdError",
    "StepPlan",
    "TenantId",
    "UnorderedDedupe",
    "pick_sample_batch",
]
