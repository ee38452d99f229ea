"""The decoded `forward_backward` call in numpy form, and the tensor checks both body formats share.

A protobuf body (`services.wire.proto`) and a legacy JSON body (`services.wire.convert`) both decode to
one `ForwardBackwardCall`, so conversion to the domain is written once. Tensors are validated here —
shape against element count, CSR structure, a cap on dense size (a sparse tensor can claim a huge
shape in a few bytes) — and every failure is a `WireError` naming the field.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from services.wire.errors import WireError

DEFAULT_MAX_TENSOR_ELEMENTS = 1 << 26
"""Largest dense tensor (elements) one loss input may expand to."""

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


def check_shape(shape: Sequence[int], field_name: str, max_elements: int) -> tuple[int, ...]:
    """Non-negative dims whose product stays within `max_elements`."""
    dims = tuple(int(s) for s in shape)
    if any(d < 0 for d in dims):
        raise WireError(f"{field_name}.shape", f"dimensions must be >= 0, got {list(dims)}")
    count = math.prod(dims)
    if count > max_elements:
        raise WireError(f"{field_name}.shape", f"{count} elements exceeds the limit of {max_elements}")
    return dims


def dense_tensor(
    flat: np.ndarray, shape: Sequence[int] | None, field_name: str, max_elements: int
) -> np.ndarray:
    """Reshape flat values to `shape`; no shape (or `[]`, which protobuf cannot tell apart) means 1-D."""
    if flat.size > max_elements:
        raise WireError(field_name, f"{flat.size} elements exceeds the limit of {max_elements}")
    if not shape:
        return flat
    dims = check_shape(shape, field_name, max_elements)
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
    max_elements: int,
) -> np.ndarray:
    """Densify a CSR tensor (unlisted cells = 0, the pad value of `loss_fn_inputs`)."""
    if shape is None or len(shape) != 2:
        raise WireError(f"{field_name}.shape", f"a sparse tensor needs a 2-D shape, got {shape}")
    nrows, ncols = check_shape(shape, field_name, max_elements)
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
