"""The decoded `forward_backward` call in numpy form, and the tensor checks both body formats share.

A protobuf body (`services.wire.proto`) and a legacy JSON body (`services.wire.convert`) both decode to
one `ForwardBackwardCall`, so conversion to the domain is written once. Tensors are validated here —
shape against element count, CSR structure — and every failure is a `WireError` naming the field.

Loss inputs are the one place a small body can become a large allocation (a CSR tensor claims a dense
shape in a few bytes; `target_tokens` may be `(T, K)`). So every dense size is charged to the request's
`ElementBudget` *before* anything is allocated: per tensor, per request (all tensors together) and on
the second dimension `K`. Keys no loss reads are refused by name, and keys the request's loss does not
read are never densified (`wanted_loss_inputs`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from services.domain.training import LOSS_FNS, LOSS_INPUTS
from services.wire.errors import WireError

DEFAULT_MAX_TENSOR_ELEMENTS = 1 << 24
"""Largest dense tensor (elements) one loss input may expand to."""
DEFAULT_MAX_REQUEST_ELEMENTS = 1 << 24
"""Most dense loss-input elements of one request, all tensors together (16 Mi: 128 MiB of int64)."""
DEFAULT_MAX_TARGET_K = 64
"""Largest `K` of a `(T, K)` loss input (K target tokens per position)."""
KNOWN_LOSS_INPUTS = frozenset(
    {"target_tokens", "weights", "logprobs", "advantages", "mask", "sequence_ratio_mask",
     "clip_low_threshold", "clip_high_threshold"}
)
"""Every `loss_fn_inputs` key a Tinker client sends for some built-in loss; any other key is refused (400)."""
MAX_CUSTOM_LOSS_INPUTS = 16
"""Most `loss_fn_inputs` keys of one datum for a `custom` loss (which names its own inputs)."""


@dataclass(frozen=True)
class TensorLimits:
    """Caps on the dense size of a request's loss inputs (see the module docstring)."""

    max_tensor_elements: int = DEFAULT_MAX_TENSOR_ELEMENTS
    max_request_elements: int = DEFAULT_MAX_REQUEST_ELEMENTS
    max_target_k: int = DEFAULT_MAX_TARGET_K


class ElementBudget:
    """The dense elements one request may still allocate; charged before every densification."""

    def __init__(self, limits: TensorLimits | None = None) -> None:
        self.limits = limits or TensorLimits()
        self.used = 0

    def charge(self, dims: Sequence[int], field_name: str) -> None:
        """Account for a tensor of shape `dims`, or raise the `WireError` naming the limit it breaks."""
        limits = self.limits
        count = math.prod(dims)
        if count > limits.max_tensor_elements:
            raise WireError(f"{field_name}.shape",
                            f"{count} elements exceeds the limit of {limits.max_tensor_elements} per tensor")
        if len(dims) >= 2 and dims[1] > limits.max_target_k:
            raise WireError(f"{field_name}.shape", f"K = {dims[1]} (shape {list(dims)}) exceeds the limit of "
                            f"{limits.max_target_k} values per position")
        if self.used + count > limits.max_request_elements:
            raise WireError(f"{field_name}.shape", f"the request's loss inputs reach {self.used + count} "
                            f"elements, over the limit of {limits.max_request_elements} per request")
        self.used += count


def wanted_loss_inputs(loss_fn: str, names: Sequence[str], field_name: str) -> set[str]:
    """The keys of `names` worth densifying for `loss_fn`; an unknown key is a `WireError`.

    A `custom` loss names its own inputs (any key, at most `MAX_CUSTOM_LOSS_INPUTS`, all densified). For a
    built-in loss, known keys it does not read are skipped (never allocated); an unsupported loss wants
    none (its conversion fails on `loss_fn` anyway).
    """
    if loss_fn == "custom":
        if len(names) > MAX_CUSTOM_LOSS_INPUTS:
            raise WireError(field_name, f"{len(names)} inputs exceeds the limit of {MAX_CUSTOM_LOSS_INPUTS}")
        return set(names)
    for name in names:
        if name not in KNOWN_LOSS_INPUTS:
            raise WireError(f"{field_name}.{name}",
                            f"unknown loss input; known: {', '.join(sorted(KNOWN_LOSS_INPUTS))}")
    if loss_fn not in LOSS_FNS:
        return set()
    return {"target_tokens", "sequence_ratio_mask", *LOSS_INPUTS[loss_fn]} & set(names)


ChunkKind = Literal["encoded_text", "image", "image_asset_pointer", "dmel"]


@dataclass(frozen=True)
class InputChunk:
    """One chunk of a datum's `model_input`; only `encoded_text` carries `tokens`."""

    type: ChunkKind
    tokens: np.ndarray | None = None
    """int32 or int64 `(n,)` token ids for `encoded_text`; None for the other kinds."""


@dataclass(frozen=True)
class ProvenanceSpan:
    """A run of a datum's positions attributed to a prompt or a sampled sequence (kept, unused)."""

    source: Literal["prompt", "sampled"]
    sequence_id: str
    offset: int
    length: int


@dataclass
class DatumArrays:
    """One training sequence: input chunks and loss inputs as numpy arrays."""

    model_input: list[InputChunk]
    loss_fn_inputs: dict[str, np.ndarray] = field(default_factory=dict)
    """Dense arrays: int64 or float32, shaped as sent."""
    model_input_spans: list[ProvenanceSpan] | None = None
    loss_fn_input_spans: list[ProvenanceSpan] | None = None


@dataclass
class ForwardBackwardCall:
    """One decoded `forward_backward` (or legacy `forward`) request, whatever its body format."""

    model_id: str
    seq_id: int | None
    """Position in the model's sequence (>= 1); None only from legacy JSON bodies without one."""
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    """Loss hyper-parameters; v2 (numbers and text) preferred over the legacy numeric map."""
    forward_only: bool
    data: list[DatumArrays]

    @property
    def num_datums(self) -> int:
        return len(self.data)

    @property
    def num_tokens(self) -> int:
        """Input tokens over all datums (text chunks only)."""
        return sum(int(c.tokens.shape[0]) for d in self.data for c in d.model_input if c.tokens is not None)


def check_shape(shape: Sequence[int], field_name: str, budget: ElementBudget) -> tuple[int, ...]:
    """Non-negative dims, charged to `budget` (which refuses them when over a limit)."""
    dims = tuple(int(s) for s in shape)
    if any(d < 0 for d in dims):
        raise WireError(f"{field_name}.shape", f"dimensions must be >= 0, got {list(dims)}")
    budget.charge(dims, field_name)
    return dims


def dense_tensor(
    flat: np.ndarray, shape: Sequence[int] | None, field_name: str, budget: ElementBudget
) -> np.ndarray:
    """Reshape flat values to `shape`; no shape (or `[]`, which protobuf cannot tell apart) means 1-D."""
    if not shape:
        budget.charge((int(flat.size),), field_name)
        return flat
    dims = check_shape(shape, field_name, budget)
    if math.prod(dims) != flat.size:
        raise WireError(
            f"{field_name}.shape", f"{list(dims)} needs {math.prod(dims)} values, got {flat.size}"
        )
    return flat.reshape(dims)


def csr_tensor(
    values: np.ndarray,
    crow: np.ndarray,
    col: np.ndarray,
    shape: Sequence[int] | None,
    field_name: str,
    budget: ElementBudget,
) -> np.ndarray:
    """Densify a CSR tensor (unlisted cells = 0, the pad value of `loss_fn_inputs`)."""
    if shape is None or len(shape) != 2:
        raise WireError(f"{field_name}.shape", f"a sparse tensor needs a 2-D shape, got {shape}")
    nrows, ncols = check_shape(shape, field_name, budget)
    nnz = int(values.shape[0])
    _check_csr(crow, col, nrows, ncols, nnz, field_name)
    dense = np.zeros((nrows, ncols), dtype=values.dtype)
    rows = np.repeat(np.arange(nrows, dtype=np.int64), np.diff(crow))
    dense[rows, col] = values
    return dense


def _check_csr(crow: np.ndarray, col: np.ndarray, nrows: int, ncols: int, nnz: int, field_name: str) -> None:
    if crow.shape[0] != nrows + 1:
        raise WireError(
            f"{field_name}.sparse_crow_indices", f"needs {nrows + 1} entries, got {crow.shape[0]}"
        )
    if crow[0] != 0 or crow[-1] != nnz or bool(np.any(np.diff(crow) < 0)):
        raise WireError(f"{field_name}.sparse_crow_indices", f"must rise monotonically from 0 to nnz={nnz}")
    if col.shape[0] != nnz:
        raise WireError(f"{field_name}.sparse_col_indices", f"needs nnz={nnz} entries, got {col.shape[0]}")
    if nnz and (int(col.min()) < 0 or int(col.max()) >= ncols):
        raise WireError(f"{field_name}.sparse_col_indices", f"must lie in [0, {ncols})")
