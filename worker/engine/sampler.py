"""Batched sampling for many tenants at once: one padded KV-cached decode over every request's rows.

`sample_batch` owns the whole sampling path of the engine: validation of each request, the padded
prefill (one row per request, each row served by its own adapter through the pass plan), expansion of
the prompt cache into `num_samples` rows, step-by-step decoding with per-row temperature / top-k /
top-p and seeded generators, stop tokens and stop strings, and prompt logprobs.

Layout and choices:
- Prompts are left-padded to the longest one, so every row's next token sits in the last column; the
  attention mask hides the pads and position ids count only real tokens (`cumsum(mask) - 1`), so a
  padded row computes what it would alone. Rows are ordered by adapter, so a pass has one LoRA
  segment per adapter (`segments_for_rows`).
- The prompt is prefilled once per request, not once per sample: the cache rows are then repeated
  (`batch_select_indices` with repeated indices) into one row per sample.
- Finished rows leave the batch (the cache, mask and positions are re-indexed), so long requests never
  pay for short ones; decoding ends when no row is left. The prefill is one model call over the whole
  batch: the scheduler bounds how many requests a batch holds.
- Stops: `stop=None` stops on the model's EOS ids, `()` never stops early, otherwise exactly the given
  token ids / strings. The stopping token is kept; a stop string is found by decoding (special tokens
  included) the last few generated tokens after each step.
- Returned logprobs are `log_softmax` of the *raw* logits (temperature 1, no top-k/top-p) at the
  sampled token: the model's own probability, which is what a forward pass over the sampled tokens
  gives (and what importance-sampling losses compare against), whatever the sampling knobs were.
- Sampling is Gumbel-max (argmax of filtered logits minus log of Exp(1) noise), exactly a categorical
  draw, with the noise drawn from the row's own generator (seed + sample index): a seeded row gives the
  same tokens whatever else shares the batch.
"""

from __future__ import annotations

import inspect
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import AutoTokenizer, DynamicCache

from services.domain.sampling import SampledSequence, SampleResult, SampleWork, SamplingParams, StopReason
from services.domain.training import AdapterId, WorkError
from services.domain.validation import InvalidWork, ModelLimits, validate_sample
from worker.engine.model import LoadedModel
from worker.engine.passes import LoraWeights, PassPlan, segments_for_rows

LayerWeights = Mapping[str, LoraWeights] | None
WeightsFor = Callable[[AdapterId | None], LayerWeights]

# Any id works for padding: padded positions are masked out and their logits are never read.
_PAD_ID = 0


class TokenDecoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


class LazyTokenizer:
    """Loads the tokenizer on first use: only requests with stop strings need one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._tokenizer: Any = None

    def decode(self, ids: list[int]) -> str:
        if self._tokenizer is None:
            self._tokenizer = AutoTokenizer.from_pretrained(self.path)
        # Special tokens stay in the text, so a stop string such as "<|im_end|>" can match.
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))


@dataclass(frozen=True)
class _Stops:
    token_ids: frozenset[int]
    strings: tuple[str, ...]
    window: int
    """Generated tokens to decode when looking for a stop string (enough to hold the longest one)."""


def _stops(params: SamplingParams, eos_token_ids: tuple[int, ...]) -> _Stops:
    """None → EOS stops; () → nothing stops; otherwise exactly the given ids / strings (EOS not added)."""
    if params.stop is None:
        return _Stops(frozenset(eos_token_ids), (), 0)
    ids = frozenset(s for s in params.stop if isinstance(s, int))
    strings = tuple(s for s in params.stop if isinstance(s, str) and s)  # "" would stop at once: ignored
    # A UTF-8 character is at most 4 bytes and a byte-level token at least 1, so 4 tokens per character
    # cover any stop string; the margin absorbs a partial character at the start of the window.
    window = 4 * max((len(s) for s in strings), default=0) + 8
    return _Stops(ids, strings, window)


@dataclass
class _Row:
    """One sample being generated."""

    params: SamplingParams
    stops: _Stops
    generator: torch.Generator | None
    """None for greedy rows, which never draw noise."""
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: StopReason | None = None


@dataclass
class _Job:
    """One admitted request: where its result goes, its adapter's weights and its rows."""

    index: int
    work: SampleWork
    weights: LayerWeights
    rows: list[_Row]
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None


def sample_batch(lm: LoadedModel, works: Sequence[SampleWork], weights_for: WeightsFor,
                 tokenizer: TokenDecoder | None = None,
                 limits: ModelLimits | None = None) -> list[SampleResult | WorkError]:
    """Sample every request in one batched decode; a request that cannot run becomes a `WorkError`.

    `weights_for(adapter_id)` gives an adapter's per-layer factors (None for the base model) and may
    raise `KeyError` for an unknown adapter. `tokenizer` is needed only for stop strings.
    """
    limits = limits or ModelLimits(lm.vocab_size, lm.max_context, lm.max_context)
    results: list[SampleResult | WorkError | None] = [None] * len(works)
    jobs = _admit(lm, works, weights_for, tokenizer, limits, results)
    if jobs:
        with torch.no_grad():
            _generate(lm, jobs, tokenizer)
    for job in jobs:
        results[job.index] = _result(job)
    return [r for r in results if r is not None]


def _admit(lm: LoadedModel, works: Sequence[SampleWork], weights_for: WeightsFor,
           tokenizer: TokenDecoder | None, limits: ModelLimits,
           results: list[SampleResult | WorkError | None]) -> list[_Job]:
    """Validated jobs, grouped by adapter (first-seen order) so each adapter's rows are contiguous."""
    weights: dict[AdapterId | None, LayerWeights] = {}
    by_adapter: dict[AdapterId | None, list[_Job]] = {}
    for i, work in enumerate(works):
        try:
            validate_sample(work, limits)
            stops = _stops(work.params, lm.eos_token_ids)
            if stops.strings and tokenizer is None:
                raise InvalidWork("sampling_params.stop", "stop strings need a tokenizer on this worker")
            if work.adapter_id not in weights:
                weights[work.adapter_id] = weights_for(work.adapter_id)
        except (InvalidWork, KeyError) as exc:
            results[i] = WorkError(str(exc), "user")
            continue
        rows = [_Row(work.params, stops, _generator(work.params, j, lm.device))
                for j in range(work.num_samples)]
        by_adapter.setdefault(work.adapter_id, []).append(_Job(i, work, weights[work.adapter_id], rows))
    return [job for group in by_adapter.values() for job in group]


def _generator(params: SamplingParams, sample_index: int, device: torch.device) -> torch.Generator | None:
    if params.temperature == 0:
        return None
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    # Offset by the sample index so a request's samples differ yet each is reproducible on its own.
    return torch.Generator(device=device).manual_seed((seed + sample_index) % (1 << 64))


@dataclass
class _Decoding:
    """The rows still generating and what their next model call needs, aligned row by row."""

    cache: DynamicCache
    mask_R_S: torch.Tensor
    """(rows, cached + next) attention mask: 0 on the left padding."""
    pos_R: torch.Tensor
    """Position of each row's last token."""
    rows: list[_Row]
    weights: list[LayerWeights]
    gathered: dict[tuple[object, ...], object] = field(default_factory=dict)
    """The adapters' factors gathered from their bank rows once for every decode step (`PassPlan.gathered`):
    no weight changes while a batch decodes (the engine's lock is held, its adapters pinned)."""
    plan: PassPlan | None = None
    """The decode steps' pass plan, shared by every step until a row leaves: its layers' routes (segments,
    layouts, stacked factors; `PassPlan.routes`) are then worked out once per layer, not once per step."""

    def keep(self, indices: list[int], next_R: torch.Tensor) -> torch.Tensor:
        """Drop the finished rows everywhere (cache included); returns the kept rows' next tokens."""
        keep_K = torch.tensor(indices, device=next_R.device)
        self.cache.batch_select_indices(keep_K)
        self.mask_R_S, self.pos_R = self.mask_R_S[keep_K], self.pos_R[keep_K]
        self.rows, self.weights = [self.rows[i] for i in indices], [self.weights[i] for i in indices]
        self.plan = None  # other rows, other segments
        return next_R[keep_K]

    def step_plan(self) -> PassPlan:
        """The plan of the next decode step (one token per row)."""
        if self.plan is None:
            self.plan = _plan(self.weights, 1, self.gathered)
        return self.plan


def _generate(lm: LoadedModel, jobs: list[_Job], tokenizer: TokenDecoder | None) -> None:
    """Prefill one row per job, fan out to one row per sample, then decode until every row stops."""
    batch, logits_R_V = _prefill(lm, jobs)
    while True:
        next_R = _step(logits_R_V, batch.rows, tokenizer)
        keep = [i for i, row in enumerate(batch.rows) if row.stop_reason is None]
        if not keep:
            return
        if len(keep) < len(batch.rows):
            next_R = batch.keep(keep, next_R)
        batch.mask_R_S = torch.cat([batch.mask_R_S, batch.mask_R_S.new_ones(len(keep), 1)], dim=1)
        batch.pos_R = batch.pos_R + 1
        logits_R_V = _forward(lm, next_R[:, None], batch.mask_R_S, batch.pos_R[:, None], batch.cache,
                              batch.step_plan())[:, -1]


def _prefill(lm: LoadedModel, jobs: list[_Job]) -> tuple[_Decoding, torch.Tensor]:
    """Run the prompts (one row per job), record prompt logprobs, and repeat the cache per sample."""
    ids_W_T, mask_W_T = _left_pad([job.work.prompt.tolist() for job in jobs], lm.device)
    pos_W_T = (mask_W_T.cumsum(-1) - 1).clamp(min=0)
    cache = DynamicCache(config=lm.model.config)
    logits_W_T_V = _forward(lm, ids_W_T, mask_W_T, pos_W_T, cache,
                            _plan([job.weights for job in jobs], ids_W_T.shape[1]))
    for w, job in enumerate(jobs):
        _prompt_logprobs(job, logits_W_T_V[w])
    row_job = [w for w, job in enumerate(jobs) for _ in job.rows]
    index_R = torch.tensor(row_job, device=lm.device)
    cache.batch_select_indices(index_R)  # repeated indices: one copy of the prompt's cache per sample
    rows = [row for job in jobs for row in job.rows]
    weights = [jobs[w].weights for w in row_job]
    batch = _Decoding(cache, mask_W_T[index_R], pos_W_T[index_R, -1], rows, weights)
    return batch, logits_W_T_V[index_R, -1]


def _left_pad(prompts: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, T) ids and attention mask, prompts right-aligned so every row ends in the last column."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), _PAD_ID, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, prompt in enumerate(prompts):
        ids[i, width - len(prompt):] = torch.tensor(prompt, dtype=torch.long)
        mask[i, width - len(prompt):] = 1
    return ids.to(device), mask.to(device)


def _plan(row_weights: list[LayerWeights], row_len: int,
          gathered: dict[tuple[object, ...], object] | None = None) -> PassPlan:
    """A plan serving each row of (rows, row_len) token ids with its own adapter."""
    return PassPlan(segments=segments_for_rows(row_weights, row_len), gathered=gathered)


def _forward(lm: LoadedModel, ids_R_T: torch.Tensor, mask_R_S: torch.Tensor, pos_R_T: torch.Tensor,
             cache: DynamicCache, plan: PassPlan) -> torch.Tensor:
    """One cached model call with each row served by its own adapter (`plan`); fp32 logits (R, T, V)."""
    with lm.ctx.plan(plan):
        out = lm.model(input_ids=ids_R_T, attention_mask=mask_R_S, position_ids=pos_R_T, use_cache=True,
                       **{_cache_kwarg(lm.model): cache})
    return out.logits.float()


def _cache_kwarg(model: torch.nn.Module) -> str:
    # transformers 5 renamed `past_key_values` to `cache` (the old name warns); older releases lack it.
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _prompt_logprobs(job: _Job, logits_T_V: torch.Tensor) -> None:
    """log p(prompt[i] | prompt[:i]) from the prefill (entry 0 is None), and the top-k when asked."""
    work = job.work
    if not work.prompt_logprobs and work.topk_prompt_logprobs <= 0:
        return
    n = len(work.prompt)
    # Left padding: the prompt fills the last n columns; column t predicts the token at t + 1.
    lp_N_V = torch.log_softmax(logits_T_V[logits_T_V.shape[0] - n : -1], dim=-1)
    if work.prompt_logprobs:
        targets = torch.as_tensor(work.prompt[1:], dtype=torch.long, device=lp_N_V.device)
        job.prompt_logprobs = [None, *lp_N_V.gather(1, targets[:, None])[:, 0].tolist()]
    if work.topk_prompt_logprobs > 0:
        top = lp_N_V.topk(min(work.topk_prompt_logprobs, lp_N_V.shape[-1]), dim=-1)
        pairs = [list(zip(i, v, strict=True)) for i, v in zip(top.indices.tolist(), top.values.tolist(),
                                                              strict=True)]
        job.topk_prompt_logprobs = [None, *pairs]


def _step(logits_R_V: torch.Tensor, rows: list[_Row], tokenizer: TokenDecoder | None) -> torch.Tensor:
    """Pick each row's next token, record it with its raw logprob and check its stops; returns (R,)."""
    next_R = _choose(logits_R_V, rows)
    logprobs_R = torch.log_softmax(logits_R_V, dim=-1).gather(1, next_R[:, None])[:, 0]
    for row, token, logprob in zip(rows, next_R.tolist(), logprobs_R.tolist(), strict=True):
        row.tokens.append(token)
        row.logprobs.append(logprob)
        row.stop_reason = _stop_reason(row, token, tokenizer)
    return next_R


def _choose(logits_R_V: torch.Tensor, rows: list[_Row]) -> torch.Tensor:
    """Greedy rows take the argmax; the others a seeded draw from their filtered distribution."""
    next_R = logits_R_V.argmax(dim=-1)
    sampled = [i for i, row in enumerate(rows) if row.generator is not None]
    if sampled:
        index_S = torch.tensor(sampled, device=logits_R_V.device)
        filtered_S_V = _filter(logits_R_V[index_S], [rows[i].params for i in sampled])
        noise_S_V = torch.stack([_exponential(rows[i].generator, logits_R_V) for i in sampled])
        next_R[index_S] = (filtered_S_V - noise_S_V.log()).argmax(dim=-1)
    return next_R


def _exponential(generator: torch.Generator | None, like_R_V: torch.Tensor) -> torch.Tensor:
    return torch.empty(like_R_V.shape[-1], device=like_R_V.device).exponential_(generator=generator)


def _filter(logits_S_V: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k and top-p (nucleus); excluded tokens get -inf."""
    device = logits_S_V.device
    temps_S = torch.tensor([p.temperature for p in params], device=device, dtype=logits_S_V.dtype)
    scaled_S_V = logits_S_V / temps_S[:, None]
    if all(p.top_k == -1 and p.top_p >= 1.0 for p in params):
        return scaled_S_V
    vocab = scaled_S_V.shape[-1]
    top_k_S = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=device)
    top_p_S = torch.tensor([p.top_p for p in params], device=device, dtype=scaled_S_V.dtype)
    sorted_S_V, order_S_V = scaled_S_V.sort(dim=-1, descending=True)
    # Both cuts are made in sorted order, so ties are broken the same way for both.
    rank_S_V = torch.arange(vocab, device=device).expand_as(sorted_S_V)
    drop_S_V = rank_S_V >= top_k_S[:, None]
    probs_S_V = torch.softmax(sorted_S_V.masked_fill(drop_S_V, float("-inf")), dim=-1)
    # Keep a token while the mass before it is below top_p: the first token always stays.
    mass_before_S_V = probs_S_V.cumsum(dim=-1) - probs_S_V
    drop_S_V = drop_S_V | (mass_before_S_V >= top_p_S[:, None])
    drop_S_V = drop_S_V.scatter(1, order_S_V, drop_S_V)
    return scaled_S_V.masked_fill(drop_S_V, float("-inf"))


def _stop_reason(row: _Row, token: int, tokenizer: TokenDecoder | None) -> StopReason | None:
    """"stop" when `token` is a stop id or completes a stop string, "length" at max_tokens."""
    stops = row.stops
    if token in stops.token_ids:
        return "stop"
    if stops.strings and tokenizer is not None:
        # Checked after every token, so a stop string can only have appeared in the newest tokens.
        text = tokenizer.decode(row.tokens[-stops.window:])
        if any(s in text for s in stops.strings):
            return "stop"
    if len(row.tokens) >= row.params.max_tokens:
        return "length"
    return None


def _result(job: _Job) -> SampleResult:
    sequences = [SampledSequence(row.tokens, row.logprobs, row.stop_reason or "length") for row in job.rows]
    return SampleResult(sequences, job.prompt_logprobs, job.topk_prompt_logprobs)
