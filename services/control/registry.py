"""The base models this service serves: name → model info, validation limits and the queue that feeds them.

The control plane validates requests against a model's `ModelLimits` at the edge and enqueues them on the
model's queue; the registry is how it finds both. A registry entry may also expose its scheduler loop's
counters (`stats`), which the control plane surfaces for metrics and health checks.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from services.control.api import Invalid, RuntimeStats, Unavailable
from services.domain.backend import BaseModelInfo
from services.domain.validation import ModelLimits

DEFAULT_MAX_LORA_RANK = 256


@dataclass(frozen=True)
class ServedModel:
    info: BaseModelInfo
    limits: ModelLimits
    """Per-datum limits (vocabulary, context, one engine pass's token budget)."""
    queue: str
    """The `WorkQueue` stream its scheduler loop claims from."""
    max_tokens_per_request: int = 32768
    """Tokens one forward/forward_backward request may hold (the scheduler's pass budget)."""
    max_lora_rank: int = DEFAULT_MAX_LORA_RANK
    stats: Callable[[], RuntimeStats] | None = None
    """Its scheduler loop's counters, when one runs in this process."""

    @property
    def name(self) -> str:
        return self.info.name


class ModelRegistry:
    """Served base models by public name (immutable after construction)."""

    def __init__(self, models: Iterable[ServedModel]) -> None:
        self._models: dict[str, ServedModel] = {}
        for model in models:
            if model.name in self._models:
                raise ValueError(f"base model {model.name!r} is registered twice")
            self._models[model.name] = model

    def names(self) -> list[str]:
        return sorted(self._models)

    def infos(self) -> list[BaseModelInfo]:
        return [self._models[name].info for name in self.names()]

    def get(self, name: str) -> ServedModel | None:
        return self._models.get(name)

    def require(self, name: str, field: str = "base_model") -> ServedModel:
        """The served model a client asked for, or `Invalid` naming what is served."""
        model = self._models.get(name)
        if model is None:
            served = ", ".join(self.names()) or "none"
            raise Invalid(f"base model {name!r} is not served here; served: {served}", field=field)
        return model

    def for_run(self, name: str) -> ServedModel:
        """The model an existing run trains on; `Unavailable` if this server no longer serves it."""
        model = self._models.get(name)
        if model is None:
            raise Unavailable(f"base model {name!r} of this run is not served by this server right now")
        return model

    def runtime_stats(self) -> list[RuntimeStats]:
        return [model.stats() for name in self.names() if (model := self._models[name]).stats is not None]
