"""The `Backend` Protocol: what the scheduler calls on a worker that holds one base model.

One call to `forward_backward` is one packed pass: several tenants' requests share the base model's
GEMMs, while each adapter's gradient stays its own. Barriers (`optim_step`, saves, loads) are separate
calls that the scheduler orders per model.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

from services.domain.sampling import SampleResult, SampleWork
from services.domain.training import (
    AdamParams,
    AdapterId,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
    OptimStepResult,
    WorkError,
)


@dataclass(frozen=True)
class BaseModelInfo:
    name: str
    """The public base-model name tenants ask for (e.g. `HuggingFaceTB/SmolLM2-135M-Instruct`)."""
    arch: str
    vocab_size: int
    max_context: int
    tokenizer_path: str
    """A local path `AutoTokenizer.from_pretrained` can load offline."""
    eos_token_ids: tuple[int, ...]


@runtime_checkable
class Backend(Protocol):
    """A worker holding one base model and many resident adapters."""

    @property
    def info(self) -> BaseModelInfo: ...

    def create_adapter(self, adapter_id: AdapterId, spec: LoraSpec) -> None: ...

    def drop_adapter(self, adapter_id: AdapterId) -> None: ...

    def has_adapter(self, adapter_id: AdapterId) -> bool: ...

    def forward_backward(
        self, works: Sequence[ForwardBackwardWork]
    ) -> list[ForwardBackwardResult | WorkError]: ...

    def optim_step(self, adapter_id: AdapterId, params: AdamParams) -> OptimStepResult: ...

    def sample(self, works: Sequence[SampleWork]) -> list[SampleResult | WorkError]: ...

    def save_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> int:
        """Write a PEFT-format adapter (plus optimizer state if asked) under `path`; return bytes written."""
        ...

    def load_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> LoraSpec:
        """Create (or replace) `adapter_id` from a checkpoint written by `save_adapter`."""
        ...


def copy_adapter(backend: Backend, source: AdapterId, target: AdapterId, scratch_dir: Path | None = None) -> None:
    """`target` := a weights-only copy of `source` (an ephemeral sampler's snapshot). In memory where the
    backend has `copy_adapter` (the engine's: no files, and the copy banked apart from trainable adapters),
    else by a save into `scratch_dir` (a temp directory there) and a load."""
    copy = getattr(backend, "copy_adapter", None)
    if callable(copy):
        copy(source, target)
        return
    if scratch_dir is not None:
        scratch_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix="adapter-copy-", dir=scratch_dir))
    try:
        backend.save_adapter(source, tmp / "copy", with_optimizer=False)
        backend.load_adapter(target, tmp / "copy", with_optimizer=False)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
