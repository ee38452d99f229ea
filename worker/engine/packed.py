"""One packed forward(/backward) pass over datums of many adapters, laid end to end in one row.

Base GEMMs run once over all tokens; each adapter's tokens form one contiguous segment for the
multi-LoRA layers; attention stays within each sequence (position ids restart at 0). The loss summed
over every training datum is back-propagated once; since adapters are separate leaves and nothing in
a transformer mixes rows across sequences, each adapter receives exactly its own gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from services.domain.custom_loss import CustomLossProgram
from services.domain.training import Datum
from worker.engine.custom_loss import CustomLossError, run_custom_loss
from worker.engine.grad_rows import settle
from worker.engine.losses import LOSSES
from worker.engine.model import LoadedModel
from worker.engine.passes import LoraWeights, PassPlan, Segment


@dataclass
class PackedItem:
    """One datum in the packed row, with what its loss needs."""

    key: object
    """Opaque id the caller uses to route the outputs back (e.g. (work index, datum index))."""
    adapter_key: object
    """Items with the same adapter key share a LoRA segment when adjacent."""
    weights: dict[str, LoraWeights] | None
    datum: Datum
    loss_fn: str
    loss_config: dict[str, float]
    train: bool
    custom_loss: CustomLossProgram | None = None
    """The program of a `custom` loss (worker/engine/custom_loss.py)."""
    request: object = None
    """The request the datum belongs to: when a custom loss fails on one of its datums, the request's other
    datums stay out of the backward too (the request fails as a whole, its adapter gets no gradient)."""


@dataclass
class ItemOutput:
    logprobs: np.ndarray
    elementwise_loss: np.ndarray
    loss: float
    metrics: dict[str, float] | None = None
    """A custom loss's own metrics (`custom/<name>:sum|mean`) for this datum."""
    error: str | None = None
    """A custom loss that failed on this datum: its request fails, the rest of the pass carries on."""


def run_packed_pass(lm: LoadedModel, items: list[PackedItem]) -> list[ItemOutput]:
    """Run one pass; items of one adapter should be adjacent (the caller groups them)."""
    train = any(item.train for item in items)
    input_ids, position_ids, seq_lens = _layout(items, lm.device)
    plan = PassPlan(segments=_segments(items), seq_lens=seq_lens)
    with torch.set_grad_enabled(train), lm.ctx.plan(plan):
        logits = lm.model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits[0]
    with torch.set_grad_enabled(train):
        outputs, total = _losses(lm, items, logits)
        if train and total is not None and total.requires_grad:
            total.backward()
            settle((item.weights for item in items if item.train and item.weights is not None), plan.written)
    return outputs


def _layout(items: list[PackedItem], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    seq_lens = [item.datum.length for item in items]
    tokens = np.concatenate([item.datum.tokens for item in items]).astype(np.int64)
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens])
    return (torch.from_numpy(tokens).to(device)[None],
            torch.from_numpy(positions).to(device)[None], seq_lens)


def _segments(items: list[PackedItem]) -> list[Segment]:
    segments: list[Segment] = []
    start = 0
    for item in items:
        end = start + item.datum.length
        if segments and segments[-1].weights is item.weights and segments[-1].end == start:
            segments[-1] = Segment(segments[-1].start, end, item.weights)
        else:
            segments.append(Segment(start, end, item.weights))
        start = end
    return segments


def _losses(lm: LoadedModel, items: list[PackedItem],
            logits: torch.Tensor) -> tuple[list[ItemOutput], torch.Tensor | None]:
    outputs: list[ItemOutput] = []
    trained: list[tuple[object, torch.Tensor]] = []
    failed: set[object] = set()
    for item, lp in zip(items, _item_logprobs(lm, items, logits), strict=True):
        inputs = {k: torch.from_numpy(np.asarray(v)).to(lm.device) for k, v in item.datum.loss_inputs.items()}
        metrics: dict[str, float] | None = None
        if item.custom_loss is not None:
            try:
                loss, custom_metrics = run_custom_loss(item.custom_loss, lp, inputs)
            except CustomLossError as exc:
                outputs.append(_failed(lp, str(exc)))
                failed.add(item.request)
                continue
            metrics = {k: float(v.detach()) for k, v in custom_metrics.items()}
            # No per-token split exists for an arbitrary loss: the datum's loss sits on its last position.
            elementwise = torch.zeros_like(lp).detach()
            elementwise.view(-1)[-1] = loss.detach()
        else:
            elementwise = LOSSES[item.loss_fn](lp, inputs, item.loss_config)
            loss = elementwise.sum()
        if item.train:
            trained.append((item.request, loss))
        outputs.append(ItemOutput(
            logprobs=lp.detach().float().cpu().numpy().astype(np.float32),
            elementwise_loss=elementwise.detach().float().cpu().numpy().astype(np.float32),
            loss=float(loss.detach()),
            metrics=metrics,
        ))
    total: torch.Tensor | None = None
    for request, loss in trained:
        if request is None or request not in failed:
            total = loss if total is None else total + loss
    return outputs, total


def _failed(lp: torch.Tensor, error: str) -> ItemOutput:
    zeros = np.zeros(tuple(lp.shape), np.float32)
    return ItemOutput(logprobs=lp.detach().float().cpu().numpy(), elementwise_loss=zeros, loss=0.0, error=error)


def _item_logprobs(lm: LoadedModel, items: list[PackedItem], logits: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every item's target logprobs. With (T,) targets (the common case) one logsumexp and one gather run
    over the whole row, then `split`: per-item slices of the (T, V) logits would each zero-fill a full-size
    gradient in backward, a cost that grows with the number of datums in a pass."""
    lengths = [item.datum.length for item in items]
    targets = [torch.from_numpy(np.asarray(item.datum.loss_inputs["target_tokens"])) for item in items]
    if all(t.dim() == 1 for t in targets):
        return target_logprobs(logits, torch.cat(targets).to(lm.device)).split(lengths)
    return tuple(target_logprobs(chunk, t.to(lm.device))
                 for chunk, t in zip(logits.split(lengths), targets, strict=True))


def target_logprobs(logits_T_V: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position; targets (T,) or (T, K) → logprobs of the same shape (fp32)."""
    logits = logits_T_V.float()
    # logsumexp keeps only the logits for backward, where log_softmax would keep a second (T, V) copy.
    lse_T = torch.logsumexp(logits, dim=-1)
    tgt = targets if targets.dim() == 2 else targets[:, None]
    picked = logits.gather(-1, tgt.long()) - lse_T[:, None]
    return picked if targets.dim() == 2 else picked[:, 0]
