"""`stable_reinforce`'s sampler logprobs, taken from what the server recorded when it sampled.

A `SamplingClient` created with `record_stability_info=True` marks its samples (`requests.record_stability`);
their results keep each sampled token's logprob. A `stable_reinforce` datum names, in
`loss_fn_input_spans`, which sampled sequence (`{request_id}:{i}`) and which of its tokens each run of loss
rows reproduces; this module fills the datum's `logprobs` input from those records, so the importance weight
is computed against the logprobs the server really sampled with, not a client's copy. Prompt runs get the
datum's own sent `logprobs` if any, else 0 (their advantages are 0 in practice). Records are the stored
sample results: tenant-scoped, and gone when the result expires.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from services.auth.tenants import Tenant
from services.control.api import Invalid
from services.control.context import ControlContext
from services.db.ids import RequestId, TenantId
from services.db.sdk_surface import recorded_samples
from services.domain.sampling import SampleResult
from services.domain.training import Datum, ForwardBackwardWork, SampledSpan

MAX_SEQUENCES = 4096
"""Sampled sequences one request may reference."""


class StabilityRecords:
    def __init__(self, ctx: ControlContext) -> None:
        self._ctx = ctx

    async def fill(self, tenant: Tenant, work: ForwardBackwardWork) -> ForwardBackwardWork:
        if work.loss_fn != "stable_reinforce":
            return work
        ids = sorted({_request_of(span.sequence_id) for d in work.data for span in d.loss_spans
                      if span.sequence_id is not None})
        if len(ids) > MAX_SEQUENCES:
            raise Invalid(f"references {len(ids)} sample requests; the limit is {MAX_SEQUENCES}",
                          field="data.loss_fn_input_spans")
        rows = await self._ctx.tx(lambda db: recorded_samples(db, TenantId(tenant.id), [RequestId(i) for i in ids]))
        results: dict[str, SampleResult] = {}
        for rid in ids:
            stored = await self._ctx.results.get(RequestId(rid)) if rid in rows else None
            if stored is None or not isinstance(stored.value, SampleResult):
                raise Invalid(f"sample {rid} has no recorded stability info (sample with "
                              "record_stability_info=True; records expire with the sample's result)",
                              field="data.loss_fn_input_spans")
            results[rid] = stored.value
        data = [_filled(d, results, f"data[{i}]") for i, d in enumerate(work.data)]
        return replace(work, data=data)


def _request_of(sequence_id: str) -> str:
    return sequence_id.rsplit(":", 1)[0]


def _filled(datum: Datum, results: dict[str, SampleResult], where: str) -> Datum:
    targets = np.asarray(datum.loss_inputs["target_tokens"])
    sent = datum.loss_inputs.get("logprobs")
    if not datum.loss_spans:
        if sent is None:
            raise Invalid("is required: send logprobs, or loss_fn_input_spans naming recorded samples",
                          field=f"{where}.loss_fn_inputs.logprobs")
        return datum
    if sum(s.length for s in datum.loss_spans) != targets.shape[0]:
        raise Invalid(f"span lengths must add up to len(target_tokens) = {targets.shape[0]}",
                      field=f"{where}.loss_fn_input_spans")
    q = np.zeros(targets.shape[0], np.float32) if sent is None else np.array(sent, np.float32)
    position = 0
    for span in datum.loss_spans:
        if span.sequence_id is not None:
            q[position:position + span.length] = _recorded(results, span, where)
        position += span.length
    return replace(datum, loss_inputs={**datum.loss_inputs, "logprobs": q})


def _recorded(results: dict[str, SampleResult], span: SampledSpan, where: str) -> np.ndarray:
    assert span.sequence_id is not None
    result = results[_request_of(span.sequence_id)]
    index = span.sequence_id.rsplit(":", 1)[1]
    if not index.isdigit() or int(index) >= len(result.sequences):
        raise Invalid(f"sequence {span.sequence_id!r} does not exist", field=f"{where}.loss_fn_input_spans")
    logprobs = result.sequences[int(index)].logprobs
    if span.offset + span.length > len(logprobs):
        raise Invalid(f"sequence {span.sequence_id!r} has {len(logprobs)} sampled tokens; the span ends at "
                      f"{span.offset + span.length}", field=f"{where}.loss_fn_input_spans")
    return np.asarray(logprobs[span.offset:span.offset + span.length], np.float32)
