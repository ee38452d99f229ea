"""The packed engine on CUDA in bf16 against transformers + peft alone (skipped without a GPU).

bf16 changes the order and precision of every reduction, so the tolerances are bf16's, not fp32's:
per-token logprobs within 0.1 (bf16 keeps ~3 significant digits of logits of magnitude ~10), and LoRA
gradients within 5% relative (norm). The fp32 CPU suite holds the tight 1e-5 / 1e-4 bounds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from services.domain.training import AdapterId, Datum, ForwardBackwardResult, ForwardBackwardWork, LoraSpec
from tests.reference.peft_reference import ATTN, MLP
from worker.engine.engine import Engine, EngineConfig

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LOGPROB_ATOL = 0.1
GRAD_RTOL = 0.05


def _peft_cuda(model_dir, spec: LoraSpec, factors):  # noqa: ANN001, ANN202
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa").cuda()
    targets = (ATTN if spec.train_attn else []) + (MLP if spec.train_mlp else []) + (
        ["lm_head"] if spec.train_unembed else [])
    model = get_peft_model(base, LoraConfig(r=spec.rank, lora_alpha=spec.alpha, target_modules=targets,
                                            lora_dropout=0.0))
    model.eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                layer = name.removeprefix("base_model.model.")
                module.lora_A["default"].weight.copy_(factors[f"{layer}.lora_A"])
                module.lora_B["default"].weight.copy_(factors[f"{layer}.lora_B"])
    return model


@pytest.mark.parametrize("strategy", ["loop", "grouped"])
def test_packed_bf16_pass_matches_peft_alone_on_cuda(tiny_model_dir, strategy: str) -> None:  # noqa: ANN001
    engine = Engine(tiny_model_dir, name="tiny", config=EngineConfig(device="cuda", dtype="bfloat16",
                                                                     lora_strategy=strategy))
    rng = np.random.default_rng(0)
    vocab = engine.info.vocab_size
    specs = [LoraSpec(rank=r, seed=r) for r in (4, 8, 16, 32)]
    works = []
    for spec in specs:
        aid = AdapterId(f"cuda-{spec.rank}")
        engine.create_adapter(aid, spec)
        with torch.no_grad():
            for key, p in engine.adapter(aid).params.items():
                if key.endswith("lora_B"):
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(spec.rank)).cuda() * 0.05)
        seqs = [rng.integers(0, vocab, int(n) + 1) for n in rng.integers(8, 40, 2)]
        data = [Datum(s[:-1], {"target_tokens": s[1:], "weights": np.ones(len(s) - 1, np.float32)}) for s in seqs]
        works.append(ForwardBackwardWork(aid, data))
    results = engine.forward_backward(works)
    for spec, work, result in zip(specs, works, results, strict=True):
        assert isinstance(result, ForwardBackwardResult)
        state = engine.adapter(work.adapter_id)
        model = _peft_cuda(tiny_model_dir, spec, {k: p.detach() for k, p in state.params.items()})
        total = 0.0
        for datum, out in zip(work.data, result.outputs, strict=True):
            ids = torch.as_tensor(datum.tokens).cuda()[None]
            logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)
            lp = logp[torch.arange(datum.length), torch.as_tensor(datum.loss_inputs["target_tokens"]).cuda()]
            np.testing.assert_allclose(out.logprobs, lp.detach().cpu().numpy(), atol=LOGPROB_ATOL)
            total = total - lp.sum()
        total.backward()
        for name, module in model.named_modules():
            if hasattr(module, "lora_A") and "default" in getattr(module, "lora_A", {}):
                layer = name.removeprefix("base_model.model.")
                for part in ("A", "B"):
                    ref = getattr(module, f"lora_{part}")["default"].weight.grad.float()
                    ours = state.grads()[f"{layer}.lora_{part}"].float()
                    err = float((ours - ref).norm() / ref.norm().clamp_min(1e-12))
                    assert err <= GRAD_RTOL, f"{layer}.lora_{part}: {err:.3f}"
