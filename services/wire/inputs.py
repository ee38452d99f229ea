"""Request-side building blocks shared by several request bodies, plus the two base classes.

Owns the scalar field types shared by request bodies (ids, seq ids, TTLs, checkpoint names,
`tinker://` paths) and the JSON shapes nested inside requests — `TensorData`, the `ModelInput`
chunks, the legacy JSON `Datum` / `ForwardBackwardInput`, `LoraConfig`, optimizer configs and
per-step params, and `SamplingParams` — with the SDK's names and field names (`tinker.types`, 0.38).

Extra-key policy: the SDK forbids extra keys client-side, so every key a 0.38 client sends is a declared
field here. We *ignore* unknown keys (`extra="ignore"`) so that a newer SDK adding an optional field keeps
working; types, required fields and ranges are validated strictly (`strict=True`: no "5" → 5 coercion,
no bool-for-int), which is where bad input actually hurts.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    model_validator,
)

INT64_MIN = -(2**63)
UINT64_MAX = 2**64 - 1
TTL_MIN_SECONDS = 3600
"""Shortest checkpoint TTL (1 hour)."""
TTL_MAX_SECONDS = 315_576_000
"""Longest checkpoint TTL (10 years of 365.25 days)."""
MAX_AGE_RECIPIENTS = 10
"""Most age recipients one external export may be encrypted to."""
MAX_ID_CHARS = 512
"""Longest id (session, model, request, sampling session) we accept."""
MAX_NAME_CHARS = 255
"""Longest checkpoint name."""
MAX_NAME_BYTES = 200
"""Longest checkpoint name in UTF-8 bytes: it becomes a directory name (filesystems allow 255 bytes)."""
MAX_METADATA_KEYS = 64
"""Most keys in one `user_metadata` map."""
MAX_METADATA_KEY_CHARS = 128
MAX_METADATA_BYTES = 16 * 1024
"""Largest `user_metadata` map, as compact JSON."""
MAX_TAGS = 64
"""Most session tags."""
MAX_TAG_CHARS = 256
MAX_STOP_STRING_CHARS = 256
"""Longest stop string: matching runs over every generated token of a shared batch."""

Id = Annotated[str, StringConstraints(min_length=1, max_length=MAX_ID_CHARS)]
TrainingSeqId = Annotated[int, Field(ge=1, le=2**31 - 1)]
"""A training request's position in its model's sequence: >= 1 (create/load is 0), int32 on the wire."""
TtlSeconds = Annotated[int, Field(ge=TTL_MIN_SECONDS, le=TTL_MAX_SECONDS)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
"""A token id: the SDK packs ids as int32 on the protobuf path, so JSON ids are held to the same range."""


def _check_checkpoint_name(name: str) -> str:
    # The name becomes the last segment of tinker://run/segment/name and a storage key: no separators.
    if not name or len(name) > MAX_NAME_CHARS:
        raise ValueError(f"checkpoint name must be 1..{MAX_NAME_CHARS} characters")
    if len(name.encode("utf-8")) > MAX_NAME_BYTES:
        raise ValueError(f"checkpoint name must be at most {MAX_NAME_BYTES} bytes in UTF-8")
    if "/" in name or "\\" in name or "\x00" in name or name in (".", ".."):
        raise ValueError("checkpoint name must not contain '/', '\\' or NUL, nor be '.' or '..'")
    return name


CheckpointName = Annotated[str, AfterValidator(_check_checkpoint_name)]


def _check_metadata(metadata: dict[str, Any]) -> dict[str, Any]:
    # Metadata is stored on rows and echoed in listings: bound it like any other stored field.
    if len(metadata) > MAX_METADATA_KEYS:
        raise ValueError(f"at most {MAX_METADATA_KEYS} keys, got {len(metadata)}")
    for key in metadata:
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise ValueError(f"keys must be at most {MAX_METADATA_KEY_CHARS} characters")
    size = len(json.dumps(metadata, separators=(",", ":"), default=str).encode("utf-8"))
    if size > MAX_METADATA_BYTES:
        raise ValueError(f"{size} bytes as JSON exceeds the limit of {MAX_METADATA_BYTES}")
    return metadata


UserMetadata = Annotated[dict[str, Any], AfterValidator(_check_metadata)]
"""Free-form caller metadata, capped in keys, key length and encoded size."""
StringMetadata = Annotated[dict[str, str], AfterValidator(_check_metadata)]
"""Caller metadata with string values, capped like `UserMetadata`."""
Tags = Annotated[list[Annotated[str, StringConstraints(max_length=MAX_TAG_CHARS)]], Field(max_length=MAX_TAGS)]
"""Session tags: at most `MAX_TAGS` of at most `MAX_TAG_CHARS` characters."""
StopString = Annotated[str, StringConstraints(max_length=MAX_STOP_STRING_CHARS)]


def _check_tinker_uri(path: str) -> str:
    if not path.startswith("tinker://"):
        raise ValueError("must be a tinker:// path")
    return path


TinkerUri = Annotated[str, AfterValidator(_check_tinker_uri)]


class WireRequest(BaseModel):
    """Base of every request model: strict types, unknown keys ignored, immutable."""

    model_config = ConfigDict(
        strict=True, extra="ignore", frozen=True, protected_namespaces=(), allow_inf_nan=False
    )


class WireResponse(BaseModel):
    """Base of every response model: we build these ourselves, so unknown keys are a bug."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


TensorDtype = Literal["int64", "float32"]


class TensorData(WireRequest):
    """JSON tensor: flat `data` plus `dtype`/`shape`; CSR-sparse when `sparse_crow_indices` is set."""

    data: list[int] | list[float]
    """Flattened values (only the listed values when sparse)."""
    dtype: TensorDtype
    """Element type; only `int64` and `float32` exist on the public wire."""
    shape: list[Annotated[int, Field(ge=0)]] | None = None
    """Dense shape; omitted means 1-D of `len(data)`. Required when sparse."""
    sparse_crow_indices: list[int] | None = None
    """CSR row pointers (`nrows + 1` entries); set together with `sparse_col_indices`."""
    sparse_col_indices: list[int] | None = None
    """CSR column index of each listed value."""


class EncodedTextChunk(WireRequest):
    """A run of token ids."""

    tokens: list[TokenId]
    """Token ids, in order (0 .. 2**31 - 1)."""
    type: Literal["encoded_text"] = "encoded_text"


class ImageChunk(WireRequest):
    """Raw image bytes. Accepted by the schema, rejected by conversion (text-only server)."""

    data: str
    """Base64 image bytes (kept encoded: we never decode images)."""
    format: Literal["png", "jpeg"]
    """Image format."""
    expected_tokens: int | None = None
    """Advisory token count of the image."""
    type: Literal["image"] = "image"


class ImageAssetPointerChunk(WireRequest):
    """An image by reference. Accepted by the schema, rejected by conversion."""

    format: Literal["png", "jpeg"]
    """Image format."""
    location: str
    """Path or URL of the image."""
    expected_tokens: int | None = None
    """Advisory token count of the image."""
    type: Literal["image_asset_pointer"] = "image_asset_pointer"


class DmelChunk(WireRequest):
    """Audio tokens as a serialized tensor container. Accepted by the schema, rejected by conversion."""

    dmel: str
    """Base64 TensorContainer bytes."""
    type: Literal["dmel"] = "dmel"


def _chunk_tag(value: Any) -> str:
    # Every SDK writes `type`; a chunk without one can only be a token run (oldest JSON clients).
    if isinstance(value, dict):
        return str(value.get("type", "encoded_text"))
    return str(getattr(value, "type", "encoded_text"))


ModelInputChunk = Annotated[
    Annotated[EncodedTextChunk, Tag("encoded_text")]
    | Annotated[ImageChunk, Tag("image")]
    | Annotated[ImageAssetPointerChunk, Tag("image_asset_pointer")]
    | Annotated[DmelChunk, Tag("dmel")],
    Discriminator(_chunk_tag),
]


class ModelInput(WireRequest):
    """The model's input: the concatenation of `chunks` in order."""

    chunks: list[ModelInputChunk]
    """Input chunks; only `encoded_text` is served here."""


class Datum(WireRequest):
    """One training sequence in the legacy JSON body (protobuf bodies decode to `DatumArrays`)."""

    loss_fn_inputs: dict[str, TensorData] = {}
    """Loss inputs aligned with `model_input` (`target_tokens`, `weights`, `advantages`, ...)."""
    model_input: ModelInput
    """The input tokens."""
    model_input_spans: list[dict[str, Any]] | None = None
    """Provenance runs over the input (accepted, unused)."""
    loss_fn_input_spans: list[dict[str, Any]] | None = None
    """Provenance runs over the targets (accepted, unused)."""


class ForwardBackwardInput(WireRequest):
    """Data plus loss of one legacy JSON forward / forward_backward call."""

    data: list[Datum]
    """The sequences of this call (one chunk of a client-side split batch)."""
    loss_fn: str
    """Loss name (`cross_entropy`, `importance_sampling`, `ppo`, ...); checked by conversion."""
    loss_fn_config: dict[str, float | str] | None = None
    """Loss hyper-parameters (e.g. `clip_low_threshold`); strings only for `custom`."""


class LoraConfig(WireRequest):
    """Adapter shape requested by `create_model`."""

    rank: int = Field(ge=1)
    """LoRA rank, >= 1."""
    seed: int | None = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    """Initialisation seed; None = server's choice."""
    train_unembed: bool = True
    """Adapt the unembedding (lm_head)."""
    train_mlp: bool = True
    """Adapt the MLP projections."""
    train_attn: bool = True
    """Adapt the attention projections."""

    @model_validator(mode="after")
    def _some_target(self) -> LoraConfig:
        if not (self.train_unembed or self.train_mlp or self.train_attn):
            raise ValueError("at least one of train_unembed, train_mlp, train_attn must be true")
        return self


class OptimizerConfigBase(WireRequest):
    """Optimizer family fixed at model creation (`{"type": "adamw"}` or e.g. `dimuon` + `version`)."""

    model_config = ConfigDict(extra="allow")

    type: str = "adamw"
    """Family name; family-specific keys are kept as extras."""


class AdamParams(WireRequest):
    """AdamW hyper-parameters of one `optim_step` (SDK defaults)."""

    learning_rate: float = Field(default=1e-4, ge=0)
    """Step size, >= 0."""
    beta1: float = Field(default=0.9, ge=0, lt=1)
    """First-moment decay, in [0, 1)."""
    beta2: float = Field(default=0.95, ge=0, lt=1)
    """Second-moment decay, in [0, 1)."""
    eps: float = Field(default=1e-12, ge=0)
    """Denominator epsilon, >= 0."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay, >= 0."""
    grad_clip_norm: float = Field(default=0.0, ge=0)
    """Global gradient-norm clip; 0 disables."""


class OptimParamsBase(WireRequest):
    """Per-step params of a non-Adam family (sent as `optimizer_params`); rejected by conversion."""

    model_config = ConfigDict(extra="allow")

    type: str
    """Family name (e.g. `dimuon`); family-specific keys are kept as extras."""


def _optim_params_tag(value: Any) -> str:
    # AdamParams has no `type`; anything carrying one belongs to another optimizer family.
    if isinstance(value, dict):
        return "other" if "type" in value else "adam"
    return "other" if isinstance(value, OptimParamsBase) else "adam"


OptimParams = Annotated[
    Annotated[AdamParams, Tag("adam")] | Annotated[OptimParamsBase, Tag("other")],
    Discriminator(_optim_params_tag),
]


class SamplingParams(WireRequest):
    """Decoding parameters of one `asample`."""

    max_tokens: int | None = Field(default=None, ge=1)
    """Most tokens to generate, >= 1; None = the server's default."""
    seed: int | None = Field(default=None, ge=INT64_MIN, le=UINT64_MAX)
    """Sampling seed; None = random."""
    stop: StopString | list[StopString] | list[TokenId] | None = None
    """Stop string(s) or stop token ids; None keeps EOS stopping, [] disables every stop incl. EOS."""
    temperature: float = Field(default=1.0, ge=0)
    """Softmax temperature, >= 0 (0 = greedy)."""
    top_k: int = Field(default=-1, ge=-1)
    """Top-k cut-off; -1 (or 0) disables."""
    top_p: float = Field(default=1.0, gt=0, le=1)
    """Nucleus probability mass, in (0, 1]."""
