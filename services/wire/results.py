"""Proto-typed results in numpy form: `ForwardBackwardOutput` and `SampleResponse` (plus parts).

These mirror the SDK 0.38 dataclasses of the same names (same field names, numpy where the SDK keeps
numpy), are what `services.wire.proto` encodes, and also render the legacy JSON shape for SDKs <= 0.24.
Metric keys are checked on construction: the SDK splits every key on `:` into exactly
`name:reduction`, so a bad key would crash the client, not us.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

StopReason = Literal["length", "stop"]
MASK_LOGPROB = -99999.0
"""Top-k filler logprob (with token 0) for empty slots; a row starting with it decodes as None."""
METRIC_REDUCTIONS = frozenset({"sum", "mean", "min", "max", "slack", "hash2", "unique"})
"""Reductions the SDK knows how to merge across chunks (others are silently dropped by it)."""


def check_metric_key(key: str) -> None:
    """Raise ValueError unless `key` is `name:reduction` with one colon and a known reduction."""
    name, sep, reduction = key.partition(":")
    if not sep or not name or ":" in reduction or reduction not in METRIC_REDUCTIONS:
        raise ValueError(
            f"metric key {key!r} must be 'name:reduction' with reduction in {sorted(METRIC_REDUCTIONS)}"
        )


def check_metrics(metrics: Mapping[str, float]) -> dict[str, float]:
    """Checked copy of `metrics` with float values."""
    for key in metrics:
        check_metric_key(key)
    return {k: float(v) for k, v in metrics.items()}


@dataclass(frozen=True, kw_only=True)
class ForwardBackwardOutput:
    """Result of one forward / forward_backward request: per-datum arrays plus chunk metrics."""

    loss_fn_output_type: str = "ArrayRecord"
    """Output record class name; the SDK keeps the part after the last `:`."""
    loss_fn_outputs: list[dict[str, np.ndarray]]
    """One dict per datum, in request order (`logprobs`, `elementwise_loss`); same keys for all."""
    metrics: dict[str, float] = field(default_factory=dict)
    """Partial values for this request (`loss:sum` = sum over its datums)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "metrics", check_metrics(self.metrics))
        if self.loss_fn_outputs:
            names = set(self.loss_fn_outputs[0])
            for i, out in enumerate(self.loss_fn_outputs):
                if set(out) != names:
                    raise ValueError(
                        f"loss_fn_outputs[{i}] has fields {sorted(out)}, expected {sorted(names)}"
                    )

    def to_json_dict(self) -> dict[str, Any]:
        """Legacy JSON result (SDK <= 0.24): TensorData dicts instead of protobuf."""
        return {
            "loss_fn_output_type": self.loss_fn_output_type,
            "loss_fn_outputs": [
                {name: tensor_json(arr) for name, arr in out.items()} for out in self.loss_fn_outputs
            ],
            "metrics": dict(self.metrics),
        }


@dataclass(frozen=True)
class TopkLogprobs:
    """Dense top-k matrices `(length, k)`; empty slots hold token 0 / `MASK_LOGPROB`."""

    token_ids: np.ndarray
    """int32 `(length, k)`."""
    logprobs: np.ndarray
    """float32 `(length, k)`."""

    @classmethod
    def from_rows(cls, rows: Sequence[Sequence[tuple[int, float]] | None], k: int = 0) -> TopkLogprobs:
        """Pack per-position `(token, logprob)` lists (None = not computed) into padded matrices."""
        width = max([k, *(len(r) for r in rows if r is not None)])
        token_ids = np.zeros((len(rows), width), dtype=np.int32)
        logprobs = np.full((len(rows), width), MASK_LOGPROB, dtype=np.float32)
        for i, row in enumerate(rows):
            for j, (token, logprob) in enumerate(row or ()):
                token_ids[i, j] = token
                logprobs[i, j] = logprob
        return cls(token_ids=token_ids, logprobs=logprobs)

    def to_rows(self) -> list[list[tuple[int, float]] | None]:
        """Inverse of `from_rows` (sentinel slots dropped, all-sentinel rows → None)."""
        rows: list[list[tuple[int, float]] | None] = []
        for ids, lps in zip(self.token_ids.tolist(), self.logprobs.tolist(), strict=True):
            row = [(t, lp) for t, lp in zip(ids, lps, strict=True) if not (t == 0 and lp == MASK_LOGPROB)]
            rows.append(row or None)
        return rows


@dataclass(frozen=True, kw_only=True)
class SampledSequence:
    """One generated continuation (its `sequence_id` is stamped client-side, so not carried here)."""

    stop_reason: StopReason
    """`stop` (stop token/string/EOS, which is included in `tokens_np`) or `length` (max_tokens)."""
    tokens_np: np.ndarray
    """Generated token ids `(n,)`."""
    logprobs_np: np.ndarray | None = None
    """float32 `(n,)` logprob per generated token; None = not computed."""
    topk_logprobs_np: TopkLogprobs | None = None
    """Top-k per generated position when `topk_sample_logprobs > 0`."""


@dataclass(frozen=True)
class PromptAltTokens:
    """`prompt_alt_tokens_k` draws at every prompt position after the first."""

    tokens: np.ndarray
    """int64 `[len(prompt) - 1, k]`."""
    logprobs: np.ndarray
    """float32 `[len(prompt) - 1, k]`."""


@dataclass(frozen=True, kw_only=True)
class SampleResponse:
    """Result of one `asample`: sequences in `sample_sequence_ids` order, plus prompt scoring."""

    sequences: list[SampledSequence]
    """One per requested sample."""
    prompt_logprobs_np: np.ndarray | None = None
    """float32 `(len(prompt),)`, NaN where not computed (always position 0)."""
    topk_prompt_logprobs_np: TopkLogprobs | None = None
    """Top-k per prompt position when `topk_prompt_logprobs > 0`."""
    target_prompt_logprobs: np.ndarray | None = None
    """float32, shaped like the request's `target_prompt_logprobs`."""
    prompt_cache_hit_tokens: int = 0
    """Prompt tokens served from the prefix cache."""
    prompt_alt_tokens: PromptAltTokens | None = None
    """Draws asked for by `prompt_alt_tokens_k`."""

    def to_json_dict(self) -> dict[str, Any]:
        """Legacy JSON result (SDK <= 0.24): lists, None for NaN prompt logprobs."""
        out: dict[str, Any] = {
            "type": "sample",
            "sequences": [
                {
                    "stop_reason": s.stop_reason,
                    "tokens": s.tokens_np.tolist(),
                    "logprobs": None if s.logprobs_np is None else s.logprobs_np.tolist(),
                }
                for s in self.sequences
            ],
        }
        if self.prompt_logprobs_np is not None:
            values = self.prompt_logprobs_np.tolist()
            out["prompt_logprobs"] = [None if np.isnan(v) else v for v in values]
        if self.topk_prompt_logprobs_np is not None:
            out["topk_prompt_logprobs"] = self.topk_prompt_logprobs_np.to_rows()
        return out


def tensor_json(arr: np.ndarray) -> dict[str, Any]:
    """JSON `TensorData` of a dense array (floats as float32, integers as int64)."""
    dtype = "float32" if arr.dtype.kind == "f" else "int64"
    return {"data": arr.reshape(-1).tolist(), "dtype": dtype, "shape": list(arr.shape)}
