"""Server-side custom losses: `create_custom_loss` stores a checked graph, `forward_backward` with
`loss_fn="custom"` runs it.

Creating one is a future like every compute call (protocol §4.11), but nothing needs the worker: the graph is
checked here (services/domain/custom_loss.py: allow-list, size limits) and stored, and the future is answered
at once with its `loss_id`. A graph outside the allow-list is refused with a 400 naming the node and why. A
`forward_backward` naming a `loss_id` gets the stored program attached (only the session that created it may
use it, as the SDK models it) after its datums are checked against the inputs the loss declared.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import numpy as np
from sqlalchemy.orm import Session

from services.auth.tenants import Tenant
from services.control.api import Invalid, NotFound, Submitted
from services.control.context import ControlContext, not_found
from services.control.surface_views import CustomLossCreated
from services.db.ids import ModelId, SessionId, TenantId
from services.db.request_log import mark_request_done, record_request
from services.db.runs import get_training_run
from services.db.sdk_surface import count_custom_losses, get_custom_loss, store_custom_loss
from services.db.sessions import get_session
from services.domain.custom_loss import (
    MAX_LOSSES_PER_SESSION,
    CustomLossProgram,
    InvalidCustomLoss,
    build_program,
)
from services.domain.training import ForwardBackwardWork
from services.jobqueue.protocol import ResultStatus, StoredResult

KIND = "create_custom_loss"


class CustomLossOps:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx

    async def create_custom_loss(self, tenant: Tenant, session_id: SessionId, seq: int, name: str,
                                 inputs: Sequence[Mapping[str, Any]],
                                 nodes: Sequence[Mapping[str, Any]]) -> Submitted:
        loss_id = f"loss-{secrets.token_hex(12)}"
        try:
            program = build_program(loss_id, name, inputs, nodes)
        except InvalidCustomLoss as exc:
            raise Invalid(exc.message, field=exc.field) from exc

        def tx(db: Session) -> tuple[str, str]:
            tenant_id = TenantId(tenant.id)
            if get_session(db, tenant_id, session_id) is None:
                raise NotFound(not_found("session", session_id), field="session_id")
            if count_custom_losses(db, session_id) >= MAX_LOSSES_PER_SESSION:
                raise Invalid(f"a session may create at most {MAX_LOSSES_PER_SESSION} custom losses",
                              field="custom_loss_seq_id")
            row = store_custom_loss(db, tenant_id, session_id, seq, loss_id, program.name, program.to_json(),
                                    self._ctx.clock())
            request = record_request(db, tenant_id, KIND, now=self._ctx.clock())
            mark_request_done(db, tenant_id, request.id, now=self._ctx.clock())
            return request.id, row.id

        request_id, stored_id = await self._ctx.tx(tx)
        self._ctx.results.put(request_id, StoredResult(ResultStatus.OK, CustomLossCreated(stored_id)))
        self._ctx.notifier.publish(request_id)
        return Submitted(request_id)

    async def attach(self, tenant: Tenant, model_id: ModelId, work: ForwardBackwardWork) -> ForwardBackwardWork:
        """The work with its stored program; 400 naming the input for datums that do not fit the loss."""
        if work.loss_fn != "custom":
            return work
        loss_id = work.custom_loss_id or ""

        def tx(db: Session) -> tuple[dict[str, Any] | None, bool]:
            tenant_id = TenantId(tenant.id)
            row = get_custom_loss(db, tenant_id, loss_id)
            run = get_training_run(db, tenant_id, model_id)
            same_session = row is not None and run is not None and run.session_id == row.session_id
            return (row.program if row is not None else None), same_session

        program_doc, same_session = await self._ctx.tx(tx)
        if program_doc is None or not same_session:
            raise NotFound(f"custom loss {loss_id!r} not found in this model's session",
                           field="loss_fn_config.loss_id")
        program = CustomLossProgram.from_json(loss_id, program_doc)
        for i, datum in enumerate(work.data):
            _check_datum(program, datum.loss_inputs, f"data[{i}].loss_fn_inputs")
        return replace(work, custom_loss=program)


def _check_datum(program: CustomLossProgram, inputs: Mapping[str, np.ndarray], where: str) -> None:
    targets = np.asarray(inputs["target_tokens"])
    if targets.ndim != program.inputs[0].rank:
        raise Invalid(f"target_tokens has rank {targets.ndim}, but loss {program.name!r} declared logprobs "
                      f"with rank {program.inputs[0].rank}", field=f"{where}.target_tokens")
    for declared in program.inputs[1:]:
        if declared.name not in inputs:
            raise Invalid(f"is required by custom loss {program.name!r}", field=f"{where}.{declared.name}")
        rank = np.asarray(inputs[declared.name]).ndim
        if rank != declared.rank:
            raise Invalid(f"has rank {rank}, but loss {program.name!r} declared rank {declared.rank}",
                          field=f"{where}.{declared.name}")
