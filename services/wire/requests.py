"""JSON request bodies of model and sampler operations (endpoint catalogue §4.1–§4.11).

One model per body, named after the SDK type (`tinker.types.*`) with the same field names: training
runs (`create_model`, `get_info`, `optim_step`, saves, loads), sampling (`create_sampling_session`,
`asample`) and `create_custom_loss`. Client plumbing (config, sessions, futures, telemetry) is in
`services.wire.control`, REST bodies (§4.12) in `services.wire.rest`; the extra-key policy is described
in `services.wire.inputs`. The protobuf `forward_backward` body is decoded by `services.wire.proto`; the
`ForwardBackwardRequest` / `ForwardRequest` models here are the legacy JSON forms (SDK <= 0.24).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, Field, model_validator

from services.wire.inputs import (
    MAX_AGE_RECIPIENTS,
    CheckpointName,
    ForwardBackwardInput,
    Id,
    LoraConfig,
    ModelInput,
    OptimizerConfigBase,
    OptimParams,
    SamplingParams,
    StringMetadata,
    TensorData,
    TinkerUri,
    TrainingSeqId,
    TtlSeconds,
    UserMetadata,
    WireRequest,
)


class CreateModelRequest(WireRequest):
    """Body of `create_model`: a new LoRA training run `"{session_id}:train:{model_seq_id}"`."""

    session_id: Id
    """Owning session."""
    model_seq_id: int = Field(ge=0)
    """Per-session model counter (shared with create-via-load), >= 0."""
    base_model: Id
    """Base model name, e.g. `Qwen/Qwen3-8B`."""
    user_metadata: UserMetadata | None = None
    """Caller's metadata for the training run."""
    lora_config: LoraConfig | None = None
    """Adapter shape; None = SDK defaults (rank 32, all targets)."""
    optimizer_config: OptimizerConfigBase = OptimizerConfigBase()
    """Optimizer family; only `adamw` is served (checked by conversion)."""
    type: Literal["create_model"] = "create_model"


class GetInfoRequest(WireRequest):
    """Body of `get_info`."""

    model_id: Id
    """Training run id."""
    type: Literal["get_info"] = "get_info"


class UnloadModelRequest(WireRequest):
    """Body of `unload_model` (type exists; 0.38 never calls it)."""

    model_id: Id
    """Training run id."""
    type: Literal["unload_model"] = "unload_model"


class ForwardBackwardRequest(WireRequest):
    """Legacy JSON body of `forward_backward` (SDK <= 0.24; 0.38 sends protobuf)."""

    forward_backward_input: ForwardBackwardInput
    """Data and loss."""
    model_id: Id
    """Training run id."""
    seq_id: TrainingSeqId | None = None
    """Position in the model's request sequence, >= 1."""


class ForwardRequest(WireRequest):
    """Legacy JSON body of `/api/v1/forward` (SDK <= 0.24): a forward-only pass."""

    forward_input: ForwardBackwardInput
    """Data and loss (the loss is evaluated, no gradients)."""
    model_id: Id
    """Training run id."""
    seq_id: TrainingSeqId | None = None
    """Position in the model's request sequence, >= 1."""


class OptimStepRequest(WireRequest):
    """Body of `optim_step`; params arrive as `adam_params` (AdamW) or `optimizer_params` (others)."""

    optim_params: OptimParams = Field(
        validation_alias=AliasChoices("optim_params", "adam_params", "optimizer_params")
    )
    """This step's hyper-parameters."""
    model_id: Id
    """Training run id."""
    seq_id: TrainingSeqId | None = None
    """Position in the model's request sequence, >= 1."""
    type: Literal["optim_step"] = "optim_step"


class SaveWeightsRequest(WireRequest):
    """Body of `save_weights` (`save_state`: weights + optimizer, `weights/<path>`)."""

    model_id: Id
    """Training run id."""
    path: CheckpointName | None = None
    """Checkpoint name (no `/`)."""
    seq_id: TrainingSeqId | None = None
    """Position in the model's request sequence, >= 1."""
    ttl_seconds: TtlSeconds | None = None
    """Expiry, 3600 s .. 10 years; None = never."""
    overwrite: bool = False
    """Replace an existing checkpoint of the same name."""
    user_metadata: StringMetadata | None = None
    """Metadata attached to the checkpoint."""
    type: Literal["save_weights"] = "save_weights"


class SaveWeightsForSamplerRequest(WireRequest):
    """Body of `save_weights_for_sampler`: named (`path`) or ephemeral (`sampling_session_seq_id`)."""

    model_id: Id
    """Training run id."""
    path: CheckpointName | None = None
    """Named form: checkpoint name under `sampler_weights/`."""
    sampling_session_seq_id: int | None = Field(default=None, ge=0)
    """Ephemeral form: the new sampling session's per-session counter, >= 0."""
    kind: Literal["snapshot", "inflight"] = "snapshot"
    """Fixed weights (`snapshot`) or the model's shared mutable sampler target (`inflight`)."""
    seq_id: TrainingSeqId | None = None
    """Position in the model's request sequence, >= 1."""
    ttl_seconds: TtlSeconds | None = None
    """Expiry, 3600 s .. 10 years; None = never."""
    user_metadata: StringMetadata | None = None
    """Metadata attached to the checkpoint."""
    type: Literal["save_weights_for_sampler"] = "save_weights_for_sampler"

    @model_validator(mode="after")
    def _one_form(self) -> SaveWeightsForSamplerRequest:
        if (self.path is None) == (self.sampling_session_seq_id is None):
            raise ValueError("exactly one of path and sampling_session_seq_id must be set")
        return self


class SaveWeightsExternalRequest(WireRequest):
    """Body of `save_weights_external`: a downloadable HF/PEFT export under `external_weights/`."""

    model_id: Id
    """Training run id."""
    path: CheckpointName
    """Export name (no `/`)."""
    seq_id: TrainingSeqId | None = None
    """Position in the model's request sequence, >= 1."""
    ttl_seconds: TtlSeconds | None = None
    """Expiry, 3600 s .. 10 years; None = never."""
    age_encryption_recipients: list[str] | None = Field(default=None, max_length=MAX_AGE_RECIPIENTS)
    """age / SSH public keys to encrypt every file to (at most 10)."""
    type: Literal["save_weights_external"] = "save_weights_external"


class LoadWeightsRequest(WireRequest):
    """Body of `load_weights`: create-via-load (`session_id` + `model_seq_id`) or legacy (`model_id`)."""

    model_id: Id | None = None
    """Legacy addressing: load into this existing model (with `seq_id`)."""
    seq_id: TrainingSeqId | None = None
    """Legacy addressing: position in the model's request sequence."""
    session_id: Id | None = None
    """Create-via-load: owning session of the new model."""
    model_seq_id: int | None = Field(default=None, ge=0)
    """Create-via-load: the new model's per-session counter, >= 0."""
    base_model: Id | None = None
    """Create-via-load: optional base-model override compatible with the checkpoint."""
    user_metadata: UserMetadata | None = None
    """Create-via-load: metadata of the new training run."""
    path: TinkerUri
    """`tinker://<run>/weights/<name>` checkpoint to load."""
    optimizer: bool
    """Also restore the optimizer state."""
    optimizer_config: OptimizerConfigBase | None = None
    """Optimizer of a weights-only load; None = adamw."""
    weights_access_token: str | None = None
    """Token for a checkpoint owned by another account."""
    type: Literal["load_weights"] = "load_weights"

    @model_validator(mode="after")
    def _one_addressing(self) -> LoadWeightsRequest:
        create = self.session_id is not None or self.model_seq_id is not None
        if create and self.model_id is not None:
            raise ValueError("model_id is exclusive with session_id/model_seq_id")
        if create and (self.session_id is None or self.model_seq_id is None):
            raise ValueError("create-via-load needs both session_id and model_seq_id")
        if not create and self.model_id is None:
            raise ValueError("set model_id (legacy) or session_id + model_seq_id (create-via-load)")
        return self

    @property
    def creates_model(self) -> bool:
        """True for create-via-load (the load is the new model's seq 0)."""
        return self.session_id is not None


class CreateSamplingSessionRequest(WireRequest):
    """Body of `create_sampling_session` (id `"{session_id}:sample:{sampling_session_seq_id}"`)."""

    session_id: Id
    """Owning session."""
    sampling_session_seq_id: int = Field(ge=0)
    """Per-session sampling-session counter, >= 0."""
    base_model: Id | None = None
    """Base model to sample (required without `model_path`)."""
    model_path: TinkerUri | None = None
    """`tinker://` weights to sample (usually `sampler_weights/`)."""
    type: Literal["create_sampling_session"] = "create_sampling_session"

    @model_validator(mode="after")
    def _has_target(self) -> CreateSamplingSessionRequest:
        if self.base_model is None and self.model_path is None:
            raise ValueError("at least one of model_path and base_model must be set")
        return self


class JoinSamplingSessionRequest(WireRequest):
    """Body of `join_sampling_session` (unpickled clients, only if enabled in client config)."""

    sampling_session_id: Id
    """The sampling session to join."""
    type: Literal["join_sampling_session"] = "join_sampling_session"


class SampleRequest(WireRequest):
    """Body of `asample`."""

    num_samples: int = Field(default=1, ge=1)
    """Continuations to generate, >= 1."""
    prompt: ModelInput
    """The prompt (`encoded_text` chunks only are served)."""
    sampling_params: SamplingParams
    """Decoding parameters."""
    base_model: Id | None = None
    """Sessionless form: base model (0.38 always uses `sampling_session_id`)."""
    model_path: TinkerUri | None = None
    """Sessionless form: weights path."""
    sampling_session_id: Id | None = None
    """Sampling session to run in."""
    seq_id: int | None = Field(default=None, ge=0, le=2**63 - 1)
    """Per-sampling-client counter (clones: clone_id * 10**9 + n); dedupe key with the session."""
    prompt_logprobs: bool | None = None
    """Also return the prompt's logprobs (entry 0 is None)."""
    topk_prompt_logprobs: int = Field(default=0, ge=0)
    """Top-k logprobs per prompt position, >= 0."""
    topk_sample_logprobs: int = Field(default=0, ge=0)
    """Top-k logprobs per sampled position, >= 0."""
    target_prompt_logprobs: TensorData | None = None
    """int64 `[len(prompt) - 1, K]` token ids to score (-1 = skip)."""
    prompt_alt_tokens_k: int = Field(default=0, ge=0)
    """Independent draws per prompt position, >= 0."""
    prompt_logprobs_last_n: int | None = Field(default=None, ge=1)
    """Score only the last N prompt positions, >= 1 (needs `prompt_logprobs`)."""
    record_stability_info: bool | None = None
    """Record per-sequence stability info for `stable_reinforce`."""
    type: Literal["sample"] = "sample"

    @model_validator(mode="after")
    def _consistent(self) -> SampleRequest:
        if self.sampling_session_id is not None and self.seq_id is None:
            raise ValueError("seq_id is required with sampling_session_id")
        if self.sampling_session_id is None and self.base_model is None and self.model_path is None:
            raise ValueError("one of sampling_session_id, model_path, base_model must be set")
        if self.prompt_logprobs_last_n is not None and not self.prompt_logprobs:
            raise ValueError("prompt_logprobs_last_n requires prompt_logprobs")
        return self


class CustomLossInput(WireRequest):
    """One input of a traced custom loss."""

    name: str
    """`logprobs` or a `loss_fn_inputs` key."""
    rank: Literal[0, 1, 2]
    """0 scalar, 1 `[T]`, 2 `[T, K]`."""


class CustomLossNode(WireRequest):
    """One torch.fx node of a traced custom loss, as data."""

    op: Literal["placeholder", "get_attr", "call_function", "call_method", "call_module", "output"]
    """fx opcode."""
    name: str
    """Unique node name."""
    target: str
    """Parameter, function or method name."""
    args: list[Any] = []
    """Encoded positional arguments."""
    kwargs: dict[str, Any] = {}
    """Encoded keyword arguments."""


class CustomLossGraph(WireRequest):
    """A traced custom loss: its nodes in execution order."""

    format: Literal[1] = 1
    nodes: list[CustomLossNode]
    """Nodes in execution order."""


class CreateCustomLossRequest(WireRequest):
    """Body of `create_custom_loss` (only if `custom_loss_server_side`)."""

    session_id: Id
    """Owning session."""
    custom_loss_seq_id: int = Field(ge=0)
    """Per-session custom-loss counter."""
    name: str
    """Loss name."""
    inputs: list[CustomLossInput]
    """Graph inputs, `logprobs` first."""
    graph: CustomLossGraph
    """The traced loss."""
    type: Literal["create_custom_loss"] = "create_custom_loss"
