"""`POST create_custom_loss`: upload a traced custom loss (protocol §4.11) for server-side execution.

The body is the SDK's torch.fx trace as data. The control plane checks it against the allow-list and size
limits of services/domain/custom_loss.py (400 naming the node and the reason otherwise) and stores it; the
future answers `{"loss_id"}` at once. `forward_backward(loss_fn="custom", loss_fn_config={"loss_id": ...})`
of the same session then runs it in the worker, on the pass's logprobs, beside other tenants' losses.
"""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from gateway.deps import Control, CurrentTenant, RawBody, documents_body, parse_body
from gateway.rendering import wire_json
from services.db.ids import SessionId
from services.wire.requests import CreateCustomLossRequest
from services.wire.responses import UntypedAPIFuture

router = APIRouter(prefix="/api/v1", tags=["training"])


@router.post("/create_custom_loss", response_model=UntypedAPIFuture)
@documents_body(CreateCustomLossRequest)
async def create_custom_loss(tenant: CurrentTenant, control: Control, body: RawBody) -> JSONResponse:
    """Store a custom loss of a session; result: `CreateCustomLossResponse` (`loss_id`)."""
    request = parse_body(CreateCustomLossRequest, body)
    submitted = await control.create_custom_loss(
        tenant, SessionId(request.session_id), request.custom_loss_seq_id, request.name,
        [i.model_dump() for i in request.inputs], [n.model_dump() for n in request.graph.nodes],
    )
    return wire_json(UntypedAPIFuture(request_id=submitted.request_id))
