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
from worker.engine.lora import MultiLoraLinear, iter_targets, target_suffixes
from worker.engine.passes import LoraWeights

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

    def layer_weights(self, *, trainable: bool) -> dict[str, LoraWeights]:
        """The factors per layer name for a pass plan; detached when this pass must not train them."""
        out: dict[str, LoraWeights] = {}
        banks = self.placement.layers if self.placement is not None else {}
        slot = self.placement.slot if self.placement is not None else -1
        for name in self.layer_names():
            a, b = self.params[f"{name}.lora_A"], self.params[f"{name}.lora_B"]
            if not trainable:
                a, b = a.detach(), b.detach()
            out[name] = LoraWeights(a, b, self.spec.scale, banks.get(name), slot)
        return out

    def layer_names(self) -> list[str]:
        return sorted({k.rsplit(".", 1)[0] for k in self.params})

    def parameters(self) -> list[nn.Parameter]:
        return [self.params[k] for k in sorted(self.params)]

    def zero_grad(self) -> None:
        for p in self.params.values():
            p.grad = None
        self.pending_grad_passes = 0

    def num_bytes(self) -> int:
        n = sum(p.numel() * p.element_size() for p in self.params.values())
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
