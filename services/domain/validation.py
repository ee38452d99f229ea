"""Validation of training and sampling work against a base model's limits, before anything runs.

Pure numpy, so the gateway can reject bad input at the edge with a 4xx naming the field and the
limit, and the worker can re-check what reaches it (a request that slips through becomes an error
result, never a crashed pass).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from services.domain.sampling import SampleWork
from services.domain.training import LOSS_FNS, LOSS_INPUTS, OPTIONAL_LOSS_INPUTS, Datum, ForwardBackwardWork


class InvalidWork(ValueError):
    """A request that cannot run; `field` names what is wrong, the message says the limit."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


MAX_TOPK_PROMPT_CELLS = 16 * 1024 * 1024
"""Most `len(prompt) * topk_prompt_logprobs` of one sample request: the result pads every prompt position
to k (token id + logprob, 8 bytes a cell), so this bounds it at 128 MiB."""


@dataclass(frozen=True)
class ModelLimits:
    vocab_size: int
    max_context: int
    max_tokens_per_pass: int


def validate_forward_backward(work: ForwardBackwardWork, limits: ModelLimits) -> None:
    if work.loss_fn not in LOSS_FNS:
        raise InvalidWork("loss_fn", f"unknown loss function {work.loss_fn!r}; supported: {', '.join(LOSS_FNS)}")
    if not work.data:
        raise InvalidWork("data", "at least one datum is required")
    if work.loss_fn == "custom" and work.custom_loss is None:
        raise InvalidWork("loss_fn_config.loss_id", "names no custom loss of this session")
    for i, datum in enumerate(work.data):
        _validate_datum(datum, f"data[{i}]", work.loss_fn, limits)
    for key, value in work.loss_config.items():
        if not np.isfinite(value):
            raise InvalidWork(f"loss_fn_config.{key}", "must be a finite number")


def _validate_datum(datum: Datum, where: str, loss_fn: str, limits: ModelLimits) -> None:
    tokens = datum.tokens
    _check_tokens(tokens, f"{where}.model_input", limits)
    inputs = datum.loss_inputs
    if "target_tokens" not in inputs:
        raise InvalidWork(f"{where}.loss_fn_inputs.target_tokens", "is required")
    targets = np.asarray(inputs["target_tokens"])
    if targets.ndim not in (1, 2) or targets.shape[0] != tokens.shape[0]:
        raise InvalidWork(f"{where}.loss_fn_inputs.target_tokens",
                          f"shape {tuple(targets.shape)} must be ({tokens.shape[0]},) or "
                          f"({tokens.shape[0]}, K) to align with the model input")
    if targets.ndim == 2 and loss_fn not in ("cross_entropy", "custom"):
        raise InvalidWork(f"{where}.loss_fn_inputs.target_tokens", f"(T, K) targets need cross_entropy, not {loss_fn}")
    _check_ids(targets, f"{where}.loss_fn_inputs.target_tokens", limits.vocab_size)
    for name in LOSS_INPUTS[loss_fn]:
        _check_float_input(inputs, name, targets.shape, where)
    for name in OPTIONAL_LOSS_INPUTS.get(loss_fn, ()):
        if name in inputs:
            _check_float_input(inputs, name, targets.shape, where)


def _check_tokens(tokens: np.ndarray, field: str, limits: ModelLimits) -> None:
    if tokens.ndim != 1 or tokens.shape[0] == 0:
        raise InvalidWork(field, "must be a non-empty 1-D list of token ids")
    n = int(tokens.shape[0])
    if n > limits.max_context:
        raise InvalidWork(field, f"{n} tokens exceed the model's context limit of {limits.max_context}")
    if n > limits.max_tokens_per_pass:
        raise InvalidWork(field, f"{n} tokens exceed the per-pass token budget of {limits.max_tokens_per_pass}")
    _check_ids(tokens, field, limits.vocab_size)


def _check_ids(ids: np.ndarray, field: str, vocab_size: int) -> None:
    if not np.issubdtype(ids.dtype, np.integer):
        raise InvalidWork(field, f"token ids must be integers, got dtype {ids.dtype}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        bad = int(ids.max()) if int(ids.max()) >= vocab_size else int(ids.min())
        raise InvalidWork(field, f"token id {bad} is outside the vocabulary [0, {vocab_size})")


def _check_float_input(inputs: dict[str, np.ndarray], name: str, shape: tuple[int, ...], where: str) -> None:
    field = f"{where}.loss_fn_inputs.{name}"
    if name not in inputs:
        if name == "weights":
            return  # cross_entropy without weights: every target counts once (filled by the worker)
        raise InvalidWork(field, "is required by this loss function")
    value = np.asarray(inputs[name])
    if value.shape != shape:
        raise InvalidWork(field, f"shape {tuple(value.shape)} must equal target_tokens' shape {tuple(shape)}")
    if not np.issubdtype(value.dtype, np.floating):
        raise InvalidWork(field, f"must be floating point, got dtype {value.dtype}")
    if not np.all(np.isfinite(value)):
        raise InvalidWork(field, "must be finite (no NaN or inf)")


def validate_sample(work: SampleWork, limits: ModelLimits, max_samples: int = 128) -> None:
    _check_tokens(work.prompt, "prompt", limits)
    p = work.params
    if not 1 <= work.num_samples <= max_samples:
        raise InvalidWork("num_samples", f"must be between 1 and {max_samples}, got {work.num_samples}")
    if p.max_tokens < 1:
        raise InvalidWork("sampling_params.max_tokens", f"must be >= 1, got {p.max_tokens}")
    if work.prompt.shape[0] + p.max_tokens > limits.max_context:
        raise InvalidWork("sampling_params.max_tokens",
                          f"prompt ({work.prompt.shape[0]}) + max_tokens ({p.max_tokens}) exceed the context "
                          f"limit of {limits.max_context}")
    if p.temperature < 0 or not np.isfinite(p.temperature):
        raise InvalidWork("sampling_params.temperature", f"must be >= 0, got {p.temperature}")
    if not 0 < p.top_p <= 1:
        raise InvalidWork("sampling_params.top_p", f"must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise InvalidWork("sampling_params.top_k", f"must be -1 (off) or >= 1, got {p.top_k}")
    if work.topk_prompt_logprobs < 0:
        raise InvalidWork("topk_prompt_logprobs", "must be >= 0")
    if work.topk_prompt_logprobs > limits.vocab_size:
        raise InvalidWork("topk_prompt_logprobs",
                          f"must be <= the vocabulary size {limits.vocab_size}, got {work.topk_prompt_logprobs}")
    cells = int(work.prompt.shape[0]) * work.topk_prompt_logprobs
    if cells > MAX_TOPK_PROMPT_CELLS:
        raise InvalidWork("topk_prompt_logprobs",
                          f"len(prompt) x k = {cells} exceeds the limit of {MAX_TOPK_PROMPT_CELLS} (the rows are "
                          "returned densely); ask for a smaller k or a shorter prompt")
    if p.stop and all(isinstance(s, int) for s in p.stop):
        _check_ids(np.asarray(p.stop, dtype=np.int64), "sampling_params.stop", limits.vocab_size)
