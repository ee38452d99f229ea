"""Typed identifiers for the persisted aggregates, and the functions that mint or compose them.

Ids are plain strings/ints at runtime; the NewTypes keep a tenant id from being passed where a session
id is expected. Composite ids follow the Tinker conventions (`{session}:train:{n}`, `{session}:sample:{k}`)
so that a model id alone tells which session it belongs to.
"""

from __future__ import annotations

import secrets
from typing import NewType

TenantId = NewType("TenantId", str)
ApiKeyId = NewType("ApiKeyId", int)
SessionId = NewType("SessionId", str)
ModelId = NewType("ModelId", str)
"""A training run's id (Tinker calls it `model_id` / `training_run_id`)."""
SamplingSessionId = NewType("SamplingSessionId", str)
RequestId = NewType("RequestId", str)
CheckpointRowId = NewType("CheckpointRowId", int)
"""Surrogate key of a checkpoint row; the API addresses checkpoints by tinker path instead."""
HubPushId = NewType("HubPushId", int)

# 12 random bytes = 96 bits: collisions are not a practical concern and ids stay short in logs.
_RANDOM_BYTES = 12


def _token() -> str:
    return secrets.token_hex(_RANDOM_BYTES)


def new_tenant_id() -> TenantId:
    return TenantId(f"tenant-{_token()}")


def new_session_id() -> SessionId:
    return SessionId(f"sess-{_token()}")


def new_request_id() -> RequestId:
    return RequestId(f"req-{_token()}")


def training_run_id(session_id: SessionId, model_seq_id: int) -> ModelId:
    """The id of the `model_seq_id`-th training run the client created in `session_id`."""
    return ModelId(f"{session_id}:train:{model_seq_id}")


def sampling_session_id(session_id: SessionId, sampling_session_seq_id: int) -> SamplingSessionId:
    """The id of the `sampling_session_seq_id`-th sampling session the client created in `session_id`."""
    return SamplingSessionId(f"{session_id}:sample:{sampling_session_seq_id}")
