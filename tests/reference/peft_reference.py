"""Independent reference: plain transformers + peft, one adapter at a time, unpacked, batch of one.

Nothing here imports the engine's pass, loss or LoRA code: logprobs come from `log_softmax`, losses
are written out again from the protocol's formulas, and LoRA is peft's own implementation.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]


def peft_model(model_dir: Path, rank: int, alpha: float, factors: dict[str, torch.Tensor],
               train_attn: bool = True, train_mlp: bool = True, train_unembed: bool = True):  # noqa: ANN201
    """A peft LoRA model whose factors are copied from `factors` (`<layer>.lora_A` / `.lora_B`)."""
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    targets = (ATTN if train_attn else []) + (MLP if train_mlp else []) + (["lm_head"] if train_unembed else [])
    cfg = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, lora_dropout=0.0, bias="none")
    model = get_peft_model(base, cfg)
    model.eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                layer = name.removeprefix("base_model.model.")
                module.lora_A["default"].weight.copy_(factors[f"{layer}.lora_A"])
                module.lora_B["default"].weight.copy_(factors[f"{layer}.lora_B"])
    return model


def reference_logprobs(model, tokens: np.ndarray, targets: np.ndarray) -> torch.Tensor:  # noqa: ANN001
    ids = torch.as_tensor(tokens, dtype=torch.long)[None]
    logits = model(input_ids=ids).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    tgt = torch.as_tensor(targets, dtype=torch.long)
    if tgt.dim() == 1:
        return logp[torch.arange(len(tgt)), tgt]
    return torch.stack([logp[torch.arange(len(tgt)), tgt[:, k]] for k in range(tgt.shape[1])], dim=1)


def reference_loss(loss_fn: str, lp: torch.Tensor, inputs: dict[str, np.ndarray],
                   config: dict[str, float]) -> torch.Tensor:
    """Elementwise loss, transcribed independently from the wire protocol's §6.3 table."""
    t = {k: torch.as_tensor(v) for k, v in inputs.items()}
    if loss_fn == "cross_entropy":
        return -(t["weights"] * lp)
    q, adv = t["logprobs"], t["advantages"]
    ratio = (lp - q).exp()
    lo, hi = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    if loss_fn == "importance_sampling":
        return -(ratio * adv)
    if loss_fn == "ppo":
        unclipped, clipped = ratio * adv, torch.clamp(ratio, lo, hi) * adv
        return -torch.where(unclipped < clipped, unclipped, clipped)
    if loss_fn == "cispo":
        return -(torch.clamp(ratio, lo, hi).detach() * adv * lp)
    if loss_fn == "dro":
        beta = config.get("beta", 0.05)
        return -(adv * lp) + 0.5 * beta * (lp - q).pow(2)
    raise ValueError(loss_fn)


def lora_grads(model) -> dict[str, torch.Tensor]:  # noqa: ANN001
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
            layer = name.removeprefix("base_model.model.")
            out[f"{layer}.lora_A"] = module.lora_A["default"].weight.grad.clone()
            out[f"{layer}.lora_B"] = module.lora_B["default"].weight.grad.clone()
    return out
