"""Sampling-side conversions between wire forms and `services.domain.sampling`.

Wire → domain: `SampleRequest` / `SamplingParams` → `SampleWork` / domain `SamplingParams`, rejecting
(with `WireError`) request features this server does not compute rather than silently dropping them —
the SDK itself fails when e.g. `prompt_alt_tokens` are missing from an answer that asked for them.
Domain → wire: `SampleResult` → `SampleResponse` (numpy form, encoded by `services.wire.proto`),
honouring `prompt_logprobs_last_n` by blanking the earlier positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import numpy as np

from services.domain import sampling as domain
from services.domain.training import AdapterId
from services.wire.convert import chunks_from_model_input, tokens_from_chunks
from services.wire.errors import WireError
from services.wire.inputs import SamplingParams
from services.wire.requests import SampleRequest
from services.wire.results import SampledSequence, SampleResponse, TopkLogprobs

T = TypeVar("T")

MAX_STOP_SEQUENCES = 64
"""Most stop strings / stop token ids in one request."""


def stop_to_domain(
    stop: str | list[str] | list[int] | None, field: str = "sampling_params.stop"
) -> tuple[str, ...] | tuple[int, ...] | None:
    """None keeps EOS stopping; `[]` disables every stop (EOS included); a str is one stop string."""
    if stop is None:
        return None
    items = [stop] if isinstance(stop, str) else stop
    _check_stop_items(items, field)
    # pydantic picked one list type, so the items are homogeneous.
    if items and isinstance(items[0], str):
        return tuple(str(x) for x in items)
    return tuple(int(x) for x in items)


def _check_stop_items(items: list[str] | list[int], field: str) -> None:
    if len(items) > MAX_STOP_SEQUENCES:
        raise WireError(field, f"at most {MAX_STOP_SEQUENCES} entries, got {len(items)}")
    for i, item in enumerate(items):
        if isinstance(item, str) and not item:
            raise WireError(f"{field}[{i}]", "stop strings must be non-empty")
        if isinstance(item, int) and item < 0:
            raise WireError(f"{field}[{i}]", f"stop token ids must be >= 0, got {item}")


def sampling_params_to_domain(
    params: SamplingParams, *, default_max_tokens: int | None = None
) -> domain.SamplingParams:
    """Wire → domain params. `max_tokens=None` takes `default_max_tokens`, else the domain default."""
    max_tokens = params.max_tokens
    if max_tokens is None:
        max_tokens = (
            default_max_tokens if default_max_tokens is not None else domain.SamplingParams().max_tokens
        )
    return domain.SamplingParams(
        max_tokens=max_tokens,
        temperature=params.temperature,
        # vLLM-style 0 also means "off"; the domain spells off as -1 only.
        top_k=-1 if params.top_k == 0 else params.top_k,
        top_p=params.top_p,
        seed=params.seed,
        stop=stop_to_domain(params.stop),
    )


def prompt_tokens(request: SampleRequest) -> np.ndarray:
    """int64 `(T,)` prompt ids (text chunks only)."""
    return tokens_from_chunks(chunks_from_model_input(request.prompt), "prompt.chunks")


def sample_work(
    request: SampleRequest, adapter_id: AdapterId | None, *, default_max_tokens: int | None = None
) -> domain.SampleWork:
    """The domain work item of an `asample` body (`adapter_id` None = sample the base model)."""
    _reject_unsupported(request)
    prompt = prompt_tokens(request)
    last_n = request.prompt_logprobs_last_n
    if last_n is not None and last_n > prompt.shape[0] - 1:
        raise WireError(
            "prompt_logprobs_last_n", f"must be <= len(prompt) - 1 = {prompt.shape[0] - 1}, got {last_n}"
        )
    return domain.SampleWork(
        adapter_id=adapter_id,
        prompt=prompt,
        num_samples=request.num_samples,
        params=sampling_params_to_domain(request.sampling_params, default_max_tokens=default_max_tokens),
        prompt_logprobs=bool(request.prompt_logprobs),
        topk_prompt_logprobs=request.topk_prompt_logprobs,
        record_stability_info=bool(request.record_stability_info),
    )


def _reject_unsupported(request: SampleRequest) -> None:
    if request.topk_sample_logprobs:
        raise WireError("topk_sample_logprobs", "is not supported by this server (must be 0)")
    if request.target_prompt_logprobs is not None:
        raise WireError("target_prompt_logprobs", "is not supported by this server (must be absent)")
    if request.prompt_alt_tokens_k:
        raise WireError("prompt_alt_tokens_k", "is not supported by this server (must be 0)")


def sample_response(
    result: domain.SampleResult,
    *,
    topk_prompt_logprobs: int = 0,
    prompt_logprobs_last_n: int | None = None,
) -> SampleResponse:
    """Domain result → wire result. Pass the request's `topk_prompt_logprobs` (pads rows to k) and
    `prompt_logprobs_last_n` (positions before the last N become None, as the SDK checks)."""
    prompt_lp = result.prompt_logprobs
    topk_rows = result.topk_prompt_logprobs
    if prompt_logprobs_last_n is not None:
        prompt_lp = _blank_prefix(prompt_lp, prompt_logprobs_last_n)
        topk_rows = _blank_prefix(topk_rows, prompt_logprobs_last_n)
    return SampleResponse(
        sequences=[_sequence(s, i) for i, s in enumerate(result.sequences)],
        prompt_logprobs_np=None if prompt_lp is None else _nan_for_none(prompt_lp),
        topk_prompt_logprobs_np=(
            None if topk_rows is None else TopkLogprobs.from_rows(topk_rows, topk_prompt_logprobs)
        ),
    )


def _sequence(seq: domain.SampledSequence, index: int) -> SampledSequence:
    if seq.logprobs and len(seq.logprobs) != len(seq.tokens):
        raise ValueError(f"sequence {index}: {len(seq.logprobs)} logprobs for {len(seq.tokens)} tokens")
    return SampledSequence(
        stop_reason=seq.stop_reason,
        tokens_np=np.asarray(seq.tokens, dtype=np.int32),
        # An empty list for a non-empty sequence means "not computed": the SDK expects None then.
        logprobs_np=np.asarray(seq.logprobs, dtype=np.float32) if seq.logprobs else None,
    )


def _blank_prefix(values: Sequence[T | None] | None, last_n: int) -> list[T | None] | None:
    if values is None:
        return None
    keep_from = max(len(values) - last_n, 0)
    return [None if i < keep_from else v for i, v in enumerate(values)]


def _nan_for_none(values: Sequence[float | None]) -> np.ndarray:
    return np.asarray([np.nan if v is None else v for v in values], dtype=np.float32)
