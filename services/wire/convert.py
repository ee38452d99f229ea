"""Training-side conversions between wire forms and `services.domain` types.

Wire → domain (raising `WireError` for anything the domain cannot represent): a decoded
`ForwardBackwardCall` → `ForwardBackwardWork`, `LoraConfig` → `LoraSpec`, optimizer params →
`AdamParams`. Also the legacy JSON forward_backward bodies → `ForwardBackwardCall`, and one entry point
that decodes either body format. Domain → wire: `ForwardBackwardResult` → `ForwardBackwardOutput`,
`OptimStepResult` → `OptimStepResponse`, `WorkError` → `RequestFailedResponse`, model info →
`GetInfoResponse`. Sampling conversions live in `services.wire.sampling`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from services.domain import training as domain
from services.domain.backend import BaseModelInfo
from services.wire import proto
from services.wire.arrays import (
    DatumArrays,
    ElementBudget,
    ForwardBackwardCall,
    InputChunk,
    TensorLimits,
    csr_tensor,
    dense_tensor,
    wanted_loss_inputs,
)
from services.wire.errors import WireError, parse_request
from services.wire.inputs import (
    AdamParams,
    Datum,
    LoraConfig,
    ModelInput,
    OptimizerConfigBase,
    OptimParamsBase,
    TensorData,
)
from services.wire.requests import ForwardBackwardRequest, ForwardRequest
from services.wire.responses import GetInfoResponse, ModelData, OptimStepResponse, RequestFailedResponse
from services.wire.results import ForwardBackwardOutput, check_metrics

_JSON_DTYPES = {"int64": np.int64, "float32": np.float32}


def tensor_from_json(td: TensorData, field: str, budget: ElementBudget | None = None) -> np.ndarray:
    """Dense numpy array of a JSON `TensorData` (CSR densified with 0), charged to `budget`."""
    budget = budget or ElementBudget()
    try:
        values = np.asarray(td.data, dtype=_JSON_DTYPES[td.dtype])
    except (OverflowError, ValueError) as exc:
        raise WireError(f"{field}.data", f"does not fit {td.dtype}: {exc}") from exc
    if td.sparse_crow_indices is None and td.sparse_col_indices is None:
        return dense_tensor(values, td.shape, field, budget)
    if td.sparse_crow_indices is None or td.sparse_col_indices is None:
        raise WireError(f"{field}.sparse_crow_indices", "must be set together with sparse_col_indices")
    crow = np.asarray(td.sparse_crow_indices, dtype=np.int64)
    col = np.asarray(td.sparse_col_indices, dtype=np.int64)
    return csr_tensor(values, crow, col, td.shape, field, budget)


def chunks_from_model_input(model_input: ModelInput) -> list[InputChunk]:
    """JSON `ModelInput` chunks in their numpy form (non-text chunks keep only their kind)."""
    return [
        InputChunk(c.type, np.asarray(c.tokens, dtype=np.int64) if c.type == "encoded_text" else None)
        for c in model_input.chunks
    ]


def tokens_from_chunks(chunks: Sequence[InputChunk], field: str) -> np.ndarray:
    """int64 `(T,)` token ids of text-only input; image/audio chunks and negative ids are rejected."""
    parts: list[np.ndarray] = []
    for i, chunk in enumerate(chunks):
        if chunk.tokens is None:
            raise WireError(f"{field}[{i}]", f"{chunk.type!r} chunks are not supported; only encoded_text")
        parts.append(chunk.tokens.astype(np.int64, copy=False))
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    if tokens.size == 0:
        raise WireError(field, "must contain at least one token")
    if int(tokens.min()) < 0:
        raise WireError(field, "token ids must be >= 0")
    return tokens


def datum_from_json(datum: Datum, field: str, loss_fn: str, budget: ElementBudget) -> DatumArrays:
    """A legacy JSON datum in numpy form (only the inputs `loss_fn` reads are densified)."""
    wanted = wanted_loss_inputs(loss_fn, list(datum.loss_fn_inputs), f"{field}.loss_fn_inputs")
    return DatumArrays(
        model_input=chunks_from_model_input(datum.model_input),
        loss_fn_inputs={
            name: tensor_from_json(td, f"{field}.loss_fn_inputs.{name}", budget)
            for name, td in datum.loss_fn_inputs.items() if name in wanted
        },
    )


def call_from_json(
    request: ForwardBackwardRequest | ForwardRequest, limits: TensorLimits | None = None
) -> ForwardBackwardCall:
    """A legacy JSON `forward_backward` / `forward` body in the same form as a protobuf one."""
    forward_only = isinstance(request, ForwardRequest)
    fb_input = (
        request.forward_input if isinstance(request, ForwardRequest) else request.forward_backward_input
    )
    prefix = "forward_input" if forward_only else "forward_backward_input"
    budget = ElementBudget(limits)
    try:
        data = [datum_from_json(d, f"{prefix}.data[{i}]", fb_input.loss_fn, budget)
                for i, d in enumerate(fb_input.data)]
    except WireError as err:
        raise err.with_ids(request.model_id, request.seq_id) from None
    return ForwardBackwardCall(
        model_id=request.model_id,
        seq_id=request.seq_id,
        loss_fn=fb_input.loss_fn,
        loss_fn_config=dict(fb_input.loss_fn_config or {}),
        forward_only=forward_only,
        data=data,
    )


@dataclass(frozen=True)
class ParsedForwardBackward:
    """A parsed `forward_backward` body whose tensors are not densified yet.

    The gateway reads the ids, checks that the model is the caller's, and only then calls `densify`
    (the expensive part), so nobody can make the server allocate for a model that is not theirs.
    """

    model_id: str | None
    seq_id: int | None
    densify: Callable[[], ForwardBackwardCall]


def parse_forward_backward_body(
    body: bytes,
    content_type: str | None,
    content_encoding: str | None = None,
    *,
    legacy_forward: bool = False,
    max_body_bytes: int = proto.DEFAULT_MAX_BODY_BYTES,
    limits: TensorLimits | None = None,
) -> ParsedForwardBackward:
    """Parse a `forward_backward` body by `Content-Type` (protobuf, else legacy JSON).

    `legacy_forward=True` is for `/api/v1/forward` (JSON `ForwardRequest`, always forward-only).
    """
    if content_type and proto.CONTENT_TYPE_PROTOBUF in content_type.lower():
        msg = proto.parse_forward_backward_message(body, content_encoding, max_body_bytes=max_body_bytes)
        return ParsedForwardBackward(*proto.message_ids(msg), lambda: proto.call_from_message(msg, limits))
    raw = proto.decompress_body(body, content_encoding, max_body_bytes=max_body_bytes)
    request: ForwardBackwardRequest | ForwardRequest = (
        parse_request(ForwardRequest, raw) if legacy_forward else parse_request(ForwardBackwardRequest, raw)
    )
    return ParsedForwardBackward(request.model_id, request.seq_id, lambda: call_from_json(request, limits))


def decode_forward_backward_body(
    body: bytes,
    content_type: str | None,
    content_encoding: str | None = None,
    *,
    legacy_forward: bool = False,
    max_body_bytes: int = proto.DEFAULT_MAX_BODY_BYTES,
    limits: TensorLimits | None = None,
) -> ForwardBackwardCall:
    """Parse and densify a `forward_backward` body in one go (see `parse_forward_backward_body`)."""
    return parse_forward_backward_body(
        body, content_type, content_encoding, legacy_forward=legacy_forward, max_body_bytes=max_body_bytes,
        limits=limits,
    ).densify()


MAX_CUSTOM_INPUT_ELEMENTS = 1 << 22
"""Elements of one custom-loss input of one datum (its rank-0/1/2 arrays are not tied to the input length)."""


def loss_config_to_domain(
    config: Mapping[str, float | str], field: str = "loss_fn_config"
) -> dict[str, float]:
    """Numeric, finite loss hyper-parameters (the one text value, `custom`'s `loss_id`, is taken apart
    by `forward_backward_work`)."""
    out: dict[str, float] = {}
    for key, value in config.items():
        if key == "loss_id":
            continue
        if isinstance(value, str) or not np.isfinite(value):
            raise WireError(f"{field}.{key}", f"must be a finite number, got {value!r}")
        out[key] = float(value)
    return out


def loss_fn_to_domain(loss_fn: str) -> domain.LossFnName:
    """The domain loss name; unsupported losses (gspo, stable_reinforce, custom, ...) are rejected."""
    for name in domain.LOSS_FNS:
        if name == loss_fn:
            return name
    raise WireError("loss_fn", f"unsupported loss {loss_fn!r}; supported: {', '.join(domain.LOSS_FNS)}")


def datum_to_domain(datum: DatumArrays, loss_fn: domain.LossFnName, field: str) -> domain.Datum:
    """Check a datum against its loss and keep only the inputs that loss reads.

    `target_tokens`: int64 `(T,)` or `(T, K)` with `T` = input length, ids >= 0; every other input the
    loss needs: float32, finite, shaped like `target_tokens`. Other keys are dropped.
    """
    tokens = tokens_from_chunks(datum.model_input, f"{field}.model_input")
    inputs = datum.loss_fn_inputs
    target = _required_input(inputs, "target_tokens", loss_fn, field)
    target_field = f"{field}.loss_fn_inputs.target_tokens"
    if target.dtype != np.int64:
        raise WireError(f"{target_field}.dtype", f"must be int64, got {target.dtype}")
    if target.ndim not in (1, 2) or target.shape[0] != tokens.shape[0]:
        raise WireError(
            f"{target_field}.shape",
            f"must be (T,) or (T, K) with T = len(model_input) = {tokens.shape[0]}, got {list(target.shape)}",
        )
    if target.size and int(target.min()) < 0:
        raise WireError(target_field, "token ids must be >= 0")
    loss_inputs = {"target_tokens": target}
    if loss_fn == "custom":
        # The stored loss declares what it reads (and each input's rank): the control plane checks them.
        loss_inputs.update(_custom_inputs(inputs, field))
        return domain.Datum(tokens=tokens, loss_inputs=loss_inputs)
    for key in domain.LOSS_INPUTS[loss_fn]:
        if key == "weights" and key not in inputs:
            continue  # cross_entropy without weights: every target counts once (the SDK's own example)
        if key == "logprobs" and loss_fn == "stable_reinforce" and key not in inputs:
            continue  # filled from the recorded samples the datum's provenance names
        loss_inputs[key] = _float_input(
            _required_input(inputs, key, loss_fn, field), target.shape, f"{field}.loss_fn_inputs.{key}"
        )
    for key in domain.OPTIONAL_LOSS_INPUTS.get(loss_fn, ()):
        if key in inputs:
            loss_inputs[key] = _float_input(inputs[key], target.shape, f"{field}.loss_fn_inputs.{key}")
    spans = tuple(
        domain.SampledSpan(s.sequence_id if s.source == "sampled" else None, s.offset, s.length)
        for s in (datum.loss_fn_input_spans or ()) if loss_fn == "stable_reinforce"
    )
    return domain.Datum(tokens=tokens, loss_inputs=loss_inputs, loss_spans=spans)


def _custom_inputs(inputs: Mapping[str, np.ndarray], field: str) -> dict[str, np.ndarray]:
    out = {}
    for key, arr in inputs.items():
        if key == "target_tokens":
            continue
        where = f"{field}.loss_fn_inputs.{key}"
        if arr.ndim > 2 or arr.size > MAX_CUSTOM_INPUT_ELEMENTS:
            raise WireError(where, f"must have rank <= 2 and at most {MAX_CUSTOM_INPUT_ELEMENTS} elements")
        if arr.dtype == np.float32 and not bool(np.isfinite(arr).all()):
            raise WireError(where, "values must be finite")
        out[key] = arr
    return out


def _required_input(inputs: Mapping[str, np.ndarray], key: str, loss_fn: str, field: str) -> np.ndarray:
    if key not in inputs:
        raise WireError(f"{field}.loss_fn_inputs.{key}", f"is required by loss {loss_fn!r}")
    return inputs[key]


def _float_input(arr: np.ndarray, shape: tuple[int, ...], field: str) -> np.ndarray:
    if arr.dtype != np.float32:
        raise WireError(f"{field}.dtype", f"must be float32, got {arr.dtype}")
    if arr.shape != shape:
        raise WireError(
            f"{field}.shape", f"must equal target_tokens shape {list(shape)}, got {list(arr.shape)}"
        )
    if not bool(np.isfinite(arr).all()):
        raise WireError(field, "values must be finite")
    return arr


def forward_backward_work(
    call: ForwardBackwardCall, adapter_id: domain.AdapterId | None
) -> domain.ForwardBackwardWork:
    """The domain work item of a decoded call; `WireError`s carry the call's model_id / seq_id."""
    try:
        loss_fn = loss_fn_to_domain(call.loss_fn)
        if not call.data:
            raise WireError("data", "must contain at least one datum")
        data = [datum_to_domain(d, loss_fn, f"data[{i}]") for i, d in enumerate(call.data)]
        config = loss_config_to_domain(call.loss_fn_config)
        loss_id = _custom_loss_id(loss_fn, call.loss_fn_config)
    except WireError as err:
        raise err.with_ids(call.model_id, call.seq_id) from None
    return domain.ForwardBackwardWork(
        adapter_id=adapter_id, data=data, loss_fn=loss_fn, loss_config=config, forward_only=call.forward_only,
        custom_loss_id=loss_id,
    )


def _custom_loss_id(loss_fn: str, config: Mapping[str, float | str]) -> str | None:
    """`custom` needs `loss_fn_config.loss_id` (text); no other loss takes one."""
    loss_id = config.get("loss_id")
    if loss_fn != "custom":
        if loss_id is not None:
            raise WireError("loss_fn_config.loss_id", f"only loss 'custom' takes a loss_id, not {loss_fn!r}")
        return None
    if not isinstance(loss_id, str) or not loss_id:
        raise WireError("loss_fn_config.loss_id", "is required (text) for loss 'custom'")
    return loss_id


def check_optimizer_config(config: OptimizerConfigBase | None, field: str = "optimizer_config") -> None:
    """Only the AdamW family is served."""
    if config is not None and config.type != "adamw":
        raise WireError(f"{field}.type", f"only 'adamw' is supported, got {config.type!r}")


def lora_spec(config: LoraConfig | None) -> domain.LoraSpec:
    """`LoraConfig` → `LoraSpec` (None = SDK defaults: rank 32, every target)."""
    if config is None:
        return domain.LoraSpec()
    return domain.LoraSpec(
        rank=config.rank,
        seed=config.seed,
        train_attn=config.train_attn,
        train_mlp=config.train_mlp,
        train_unembed=config.train_unembed,
    )


def adam_params(params: AdamParams | OptimParamsBase, field: str = "optim_params") -> domain.AdamParams:
    """Wire AdamW params → domain; other optimizer families (`optimizer_params`) are rejected."""
    if isinstance(params, OptimParamsBase):
        raise WireError(f"{field}.type", f"only AdamW ('adam_params') is supported, got {params.type!r}")
    return domain.AdamParams(
        learning_rate=params.learning_rate,
        beta1=params.beta1,
        beta2=params.beta2,
        eps=params.eps,
        weight_decay=params.weight_decay,
        grad_clip_norm=params.grad_clip_norm,
    )


def forward_backward_output(result: domain.ForwardBackwardResult) -> ForwardBackwardOutput:
    """Per-datum `logprobs` / `elementwise_loss` plus metrics (keys checked as `name:reduction`)."""
    return ForwardBackwardOutput(
        loss_fn_outputs=[
            {"logprobs": np.asarray(o.logprobs), "elementwise_loss": np.asarray(o.elementwise_loss)}
            for o in result.outputs
        ],
        metrics=check_metrics(result.metrics),
    )


def optim_step_response(result: domain.OptimStepResult) -> OptimStepResponse:
    """`OptimStepResult` → result JSON (metric keys checked as `name:reduction`)."""
    return OptimStepResponse(metrics=check_metrics(result.metrics))


def request_failed(error: domain.WorkError | WireError) -> RequestFailedResponse:
    """The failed-future answer of `retrieve_future` (bad input is category `user`)."""
    if isinstance(error, WireError):
        return RequestFailedResponse(error=str(error), category="user")
    return RequestFailedResponse(error=error.message, category=error.category)


def get_info_response(model_id: str, info: BaseModelInfo, spec: domain.LoraSpec) -> GetInfoResponse:
    """Answer of `get_info`. `model_data.model_name` is the public model name; `tokenizer_id` is the
    base model's local tokenizer directory (`tokenizer_path`), so `TrainingClient.get_tokenizer()`
    loads it offline, without a hub (falls back to the name when no path is known)."""
    return GetInfoResponse(
        model_id=model_id,
        model_data=ModelData(
            arch=info.arch, model_name=info.name, tokenizer_id=info.tokenizer_path or info.name
        ),
        is_lora=True,
        lora_rank=spec.rank,
        model_name=info.name,
    )
