"""One tenant adapter's state: LoRA factors per layer, gradients, AdamW state and its spec.

Initialisation is deterministic from the adapter's seed alone (layers visited in sorted name order with
a private generator), so the same seed gives the same adapter whatever else is resident. B starts at
zero as in LoRA, so a fresh adapter computes exactly the base model.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from services.domain.training import AdapterId, LoraSpec
from worker.engine.banks import KINDS
from worker.engine.lora import MultiLoraLinear, iter_targets, target_suffixes
from worker.engine.passes import GradRows, LoraWeights

if TYPE_CHECKING:
    from worker.engine.banks import BankPlacement


@dataclass
class OptimizerState:
    """AdamW moments per parameter name and the number of steps taken."""

    step: int = 0
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class AdapterState:
    adapter_id: AdapterId
    spec: LoraSpec
    seed: int
    params: dict[str, nn.Parameter]
    """`<layer>.lora_A` / `<layer>.lora_B` → leaf parameter."""
    optimizer: OptimizerState = field(default_factory=OptimizerState)
    pending_grad_passes: int = 0
    """forward_backward calls accumulated since the last optim_step."""
    placement: BankPlacement | None = None
    """The bank row its factors live in while resident (worker/engine/banks.py); None: private tensors."""
    grad_rows: GradRows = field(default_factory=GradRows)
    """While placed, its gradient lives in the bank's gradient rows (valid or not); else in `.grad`."""
    sampling_only: bool = False
    """A weights-only copy a sampler reads (`Engine.copy_adapter`), never trained: banked apart from trainable
    adapters (worker/engine/banks.py) so that theirs stay in consecutive rows."""

    _weights: dict[bool, tuple[tuple[object, ...], dict[str, LoraWeights]]] = field(
        default_factory=dict, repr=False, compare=False)
    """`layer_weights` per `trainable`, with the signature of the storage it was built on."""
    _grad_views: tuple[tuple[object, ...], dict[str, torch.Tensor]] | None = field(
        default=None, repr=False, compare=False)
    """`grads()` while placed, with the signature of the gradient rows it views."""

    def layer_weights(self, *, trainable: bool) -> dict[str, LoraWeights]:
        """The factors per layer name for a pass plan (read-only); detached when this pass must not train
        them. Built once per placement and storage: with many tenants per pass, rebuilding every adapter's
        per-layer views for every call was a visible share of a small step."""
        first = next(iter(self.params.values()))
        # Placement, bank growth, release and spill all move or replace the factors' storage.
        signature = (self.placement, id(first), first.data_ptr())
        cached = self._weights.get(trainable)
        if cached is not None and cached[0] == signature:
            return cached[1]
        out: dict[str, LoraWeights] = {}
        banks = self.placement.layers if self.placement is not None else {}
        slot = self.placement.slot if self.placement is not None else -1
        rows = self.grad_rows if self.placement is not None else None
        for name in self.layer_names():
            a, b = self.params[f"{name}.lora_A"], self.params[f"{name}.lora_B"]
            if not trainable:
                a, b = a.detach(), b.detach()
            out[name] = LoraWeights(a, b, self.spec.scale, banks.get(name), slot, rows)
        self._weights[trainable] = (signature, out)
        return out

    def __getstate__(self) -> dict[str, object]:
        # A pickled state must not carry the weights cache: it references bank tensors. (Spill files no
        # longer pickle states: worker/engine/residency.py.)
        return {**self.__dict__, "_weights": {}, "_grad_views": None}

    def layer_names(self) -> list[str]:
        return sorted({k.rsplit(".", 1)[0] for k in self.params})

    def parameters(self) -> list[nn.Parameter]:
        return [self.params[k] for k in sorted(self.params)]

    def grads(self) -> dict[str, torch.Tensor]:
        """The accumulated gradient per parameter name (views of the bank's gradient rows while placed;
        read-only); empty when no pass has accumulated one since the last optimizer step."""
        if self.placement is None:
            return {k: g for k, p in self.params.items() if (g := p.grad) is not None}
        if not self.grad_rows.valid:
            return {}
        # Cached views keep their storage alive, so a matching address is the same storage.
        signature = (self.placement, next(iter(self.placement.layers.values())).grad_A.data_ptr())
        if self._grad_views is None or self._grad_views[0] != signature:
            self._grad_views = (signature, self.placement.grads())
        return self._grad_views[1]

    def zero_grad(self) -> None:
        """Forget the accumulated gradient (a placed adapter's rows are overwritten by its next pass)."""
        if self.placement is None:
            for p in self.params.values():
                p.grad = None
        self.grad_rows.valid = False
        self.pending_grad_passes = 0

    def num_bytes(self) -> int:
        """Memory this adapter holds: while placed, its bank row (factors, gradient and both moments, all
        kept there from the start); otherwise its factors, pending gradient and the moments it has."""
        factors = sum(p.numel() * p.element_size() for p in self.params.values())
        if self.placement is not None:
            return len(KINDS) * factors
        n = factors + sum(g.numel() * g.element_size() for g in self.grads().values())
        n += sum(t.numel() * t.element_size() for t in self.optimizer.exp_avg.values())
        n += sum(t.numel() * t.element_size() for t in self.optimizer.exp_avg_sq.values())
        return n

    def to(self, device: torch.device | str) -> None:
        """Move factors, gradients and optimizer moments (used to spill to host and bring back)."""
        if self.placement is not None:
            raise RuntimeError("adapter still lives in a bank row: release it (AdapterBanks.release) first")
        for key, p in list(self.params.items()):
            moved = nn.Parameter(p.detach().to(device), requires_grad=True)
            if p.grad is not None:
                moved.grad = p.grad.to(device)
            self.params[key] = moved
        for moments in (self.optimizer.exp_avg, self.optimizer.exp_avg_sq):
            for key, t in list(moments.items()):
                moments[key] = t.to(device)


def new_adapter(adapter_id: AdapterId, spec: LoraSpec, layers: dict[str, MultiLoraLinear],
                device: torch.device, dtype: torch.dtype = torch.float32) -> AdapterState:
    """Create an adapter with deterministic init from `spec.seed` (a random seed is drawn when None)."""
    seed = spec.seed if spec.seed is not None else secrets.randbits(31)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    suffixes = target_suffixes(spec.train_attn, spec.train_mlp, spec.train_unembed)
    params: dict[str, nn.Parameter] = {}
    for layer in iter_targets(layers, suffixes):
        a = torch.empty(spec.rank, layer.in_features, dtype=torch.float32)
        _kaiming_uniform_(a, gen)
        b = torch.zeros(layer.out_features, spec.rank, dtype=torch.float32)
        params[f"{layer.layer_name}.lora_A"] = nn.Parameter(a.to(device=device, dtype=dtype))
        params[f"{layer.layer_name}.lora_B"] = nn.Parameter(b.to(device=device, dtype=dtype))
    if not params:
        raise ValueError("this base model has no layers matching the requested lora_config targets")
    return AdapterState(adapter_id=adapter_id, spec=spec, seed=seed, params=params)


def _kaiming_uniform_(t: torch.Tensor, gen: torch.Generator) -> None:
    # Same distribution as nn.Linear / peft's default for lora_A (kaiming_uniform with a=sqrt(5)).
    fan_in = t.shape[1]
    gain = math.sqrt(2.0 / (1 + 5.0))
    bound = math.sqrt(3.0) * gain / math.sqrt(fan_in)
    with torch.no_grad():
        t.uniform_(-bound, bound, generator=gen)
