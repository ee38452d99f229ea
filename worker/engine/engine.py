"""`Engine`: the `Backend` a worker exposes — one base model, many resident adapters, packed passes.

`forward_backward` takes many requests (tenants), validates each on its own (a bad one becomes an
error result), groups their datums by adapter, cuts them into micro-batches under the token budget and
runs each micro-batch as one packed pass. Gradients accumulate per adapter until its `optim_step`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import numpy as np
import torch

from services.domain.backend import BaseModelInfo
from services.domain.sampling import SampleResult, SampleWork
from services.domain.training import (
    AdamParams,
    AdapterId,
    DatumOutput,
    ForwardBackwardResult,
    ForwardBackwardWork,
    LoraSpec,
    OptimStepResult,
    WorkError,
)
from services.domain.validation import InvalidWork, ModelLimits, validate_forward_backward
from worker.engine.adapters import AdapterState, new_adapter
from worker.engine.banks import order_key
from worker.engine.checkpoints import build_adapter, read_checkpoint, snapshot, write_checkpoint
from worker.engine.deferred_steps import DeferredSteps
from worker.engine.grad_guard import GradGuard
from worker.engine.host_memory import keep_freed_memory
from worker.engine.model import LoadedModel, load_base_model
from worker.engine.optim import prepare_step
from worker.engine.packed import ItemOutput, PackedItem, run_packed_pass
from worker.engine.residency import AdapterSlots, UnknownAdapter
from worker.engine.sampler import LayerWeights, LazyTokenizer, sample_batch

log = logging.getLogger(__name__)


@dataclass
class EngineConfig:
    max_tokens_per_pass: int = 8192
    """Token budget of one packed pass; larger batches run as several passes (gradients accumulate)."""
    max_resident_adapters: int = 64
    spill_dir: Path | None = None
    device: str | None = None
    dtype: str | None = None
    lora_strategy: str = "auto"
    """`auto`, `loop` or `grouped` (see worker/engine/lora.py)."""
    micro_batch_tokens: int | None = None
    """Tokens per packed pass when a call holds more (a datum longer than this runs alone); never above
    `max_tokens_per_pass`. None: `max_tokens_per_pass` on an accelerator, `CPU_MICRO_BATCH_TOKENS` on CPU."""
    keep_freed_host_memory: bool = True
    """On CPU, keep freed memory in the process for the next pass (worker/engine/host_memory.py)."""


CPU_MICRO_BATCH_TOKENS = 512
"""On CPU, passes of about 512 tokens ran fastest per token (SmolLM2-135M, fp32: 256 → 188, 512 → 202,
1,024 → 194, 2,048 → 168 tokens/s; docs/performance.md): bigger activations fall out of the caches. On a
GPU bigger passes are what keeps it busy, so there the pass budget is the only limit."""


@dataclass
class PassStats:
    passes: int = 0
    multi_adapter_passes: int = 0
    tokens: int = 0
    adapters_per_pass: list[int] = field(default_factory=list)


class Engine:
    """Implements `services.domain.backend.Backend` for one base model."""

    def __init__(self, model_dir: Path, *, name: str, tokenizer_path: str | None = None,
                 config: EngineConfig | None = None) -> None:
        self.config = config or EngineConfig()
        device = torch.device(self.config.device) if self.config.device else None
        dtype = getattr(torch, self.config.dtype) if self.config.dtype else None
        self.lm: LoadedModel = load_base_model(Path(model_dir), device=device, dtype=dtype)
        self.lm.ctx.lora_strategy = self.config.lora_strategy
        self.slots = AdapterSlots(self.lm.device, self.config.max_resident_adapters, self.config.spill_dir)
        self.stats = PassStats()
        self.steps = DeferredSteps()
        """Prepared optimizer steps not applied yet: every entry point below applies them first."""
        # One pass at a time per model: the pass context and the adapters' grads are shared state.
        self._lock = threading.RLock()
        self._info = BaseModelInfo(
            name=name, arch=self.lm.arch, vocab_size=self.lm.vocab_size, max_context=self.lm.max_context,
            tokenizer_path=str(tokenizer_path or model_dir), eos_token_ids=self.lm.eos_token_ids,
        )
        self.limits = ModelLimits(self.lm.vocab_size, self.lm.max_context, self.config.max_tokens_per_pass)
        self.micro_batch_tokens = _micro_batch_tokens(self.config, self.lm.device)
        if self.lm.device.type == "cpu" and self.config.keep_freed_host_memory:
            keep_freed_memory()
        self._tokenizer = LazyTokenizer(self._info.tokenizer_path)  # loaded on the first stop string

    @property
    def info(self) -> BaseModelInfo:
        return self._info

    # -- adapters -------------------------------------------------------------------------------
    def create_adapter(self, adapter_id: AdapterId, spec: LoraSpec) -> None:
        with self._lock:
            self.apply_pending_steps()
            state = new_adapter(adapter_id, spec, self.lm.layers, self.lm.device)
            self.slots.put(state)

    def drop_adapter(self, adapter_id: AdapterId) -> None:
        with self._lock:
            self.apply_pending_steps()
            self.slots.drop(adapter_id)

    def has_adapter(self, adapter_id: AdapterId) -> bool:
        return adapter_id in self.slots

    def adapter(self, adapter_id: AdapterId) -> AdapterState:
        """The adapter's live state (made resident); for checkpoints, tests and benchmarks."""
        with self._lock:
            self.apply_pending_steps()
            return self.slots.get(adapter_id)

    def put_adapter(self, state: AdapterState) -> None:
        with self._lock:
            self.apply_pending_steps()
            self.slots.put(state)

    def apply_pending_steps(self) -> None:
        """Apply the optimizer steps `optim_step` accepted (worker/engine/deferred_steps.py). Every other
        entry point does this first; a benchmark calls it to time a step's whole work."""
        with self._lock:
            if len(self.steps):
                self.steps.apply_all()

    # -- training -------------------------------------------------------------------------------
    def forward_backward(self, works: Sequence[ForwardBackwardWork]) -> list[ForwardBackwardResult | WorkError]:
        with self._lock:
            self.apply_pending_steps()
            results: list[ForwardBackwardResult | WorkError | None] = [None] * len(works)
            runnable = self._admit(works, results)
            items, trained = self._items(works, runnable)
            guard = GradGuard(trained)
            try:
                outputs = self._run_micro_batches(items)
            except BaseException:
                # Earlier micro-batches' gradients must not stay: the call's requests run again one by one.
                guard.restore()
                raise
            for state in trained:
                state.pending_grad_passes += 1
            for i in runnable:
                results[i] = self._result(works[i], [outputs[(i, j)] for j in range(len(works[i].data))])
            return [r for r in results if r is not None]

    def _admit(self, works: Sequence[ForwardBackwardWork],
               results: list[ForwardBackwardResult | WorkError | None]) -> list[int]:
        runnable: list[int] = []
        for i, work in enumerate(works):
            try:
                validate_forward_backward(work, self.limits)
                if work.adapter_id is not None and work.adapter_id not in self.slots:
                    raise UnknownAdapter(work.adapter_id)
                if work.adapter_id is None and not work.forward_only:
                    raise InvalidWork("model_id", "the base model is frozen: only forward passes are allowed")
                runnable.append(i)
            except (InvalidWork, UnknownAdapter) as exc:
                results[i] = WorkError(str(exc), "user")
        return runnable

    def _items(self, works: Sequence[ForwardBackwardWork],
               runnable: list[int]) -> tuple[list[PackedItem], list[AdapterState]]:
        """Datums grouped by adapter so each adapter is one contiguous segment, adapters in bank order (a
        grouped pass then reads their factors as consecutive bank rows, without copying them); and the
        adapters the call trains."""
        pinned = {works[i].adapter_id for i in runnable if works[i].adapter_id is not None}
        trains = {works[i].adapter_id for i in runnable if not works[i].forward_only}
        # Every adapter resident first: bringing one back may move others' rows (a bank growing).
        states = {aid: self.slots.get(aid, pinned=pinned) for aid in pinned}
        weights = {aid: state.layer_weights(trainable=aid in trains) for aid, state in states.items()}
        by_adapter: dict[object, list[PackedItem]] = {}
        for i in runnable:
            work = works[i]
            for j, datum in enumerate(work.data):
                datum = _with_default_weights(datum, work.loss_fn)
                item = PackedItem(key=(i, j), adapter_key=work.adapter_id,
                                  weights=weights.get(work.adapter_id), datum=datum, loss_fn=work.loss_fn,
                                  loss_config=dict(work.loss_config), train=not work.forward_only,
                                  custom_loss=work.custom_loss, request=i)
                by_adapter.setdefault(work.adapter_id, []).append(item)
        ordered = sorted(by_adapter, key=lambda aid: order_key(states[aid]) if aid is not None else (-1, 0))
        return [item for aid in ordered for item in by_adapter[aid]], [states[aid] for aid in trains]

    def _run_micro_batches(self, items: list[PackedItem]) -> dict[object, ItemOutput]:
        outputs: dict[object, ItemOutput] = {}
        for batch in _cut(items, self.micro_batch_tokens):
            started = time.perf_counter()
            for item, out in zip(batch, run_packed_pass(self.lm, batch), strict=True):
                outputs[item.key] = out
            self._record_pass(batch, time.perf_counter() - started)
        return outputs

    def _record_pass(self, batch: list[PackedItem], seconds: float) -> None:
        tokens = sum(item.datum.length for item in batch)
        adapters = len({item.adapter_key for item in batch})
        self.stats.passes += 1
        self.stats.tokens += tokens
        self.stats.adapters_per_pass.append(adapters)
        if adapters > 1:
            self.stats.multi_adapter_passes += 1
        log.debug("packed pass: %d tokens, %d adapters, %.0f tok/s", tokens, adapters, tokens / max(seconds, 1e-9))

    @staticmethod
    def _result(work: ForwardBackwardWork, outs: list[ItemOutput]) -> ForwardBackwardResult | WorkError:
        errors = [o.error for o in outs if o.error is not None]
        if errors:
            return WorkError(f"custom loss: {errors[0]}", "user")
        metrics = {"loss:sum": float(sum(o.loss for o in outs))}
        metrics.update(custom_metrics([o.metrics or {} for o in outs]))
        return ForwardBackwardResult(
            outputs=[DatumOutput(o.logprobs, o.elementwise_loss) for o in outs], metrics=metrics,
        )

    def optim_step(self, adapter_id: AdapterId, params: AdamParams) -> OptimStepResult:
        """Prepare the step (clipping, metrics) and leave its update pending: tenants stepping back to back
        then share update calls (worker/engine/deferred_steps.py)."""
        with self._lock:
            if params.grad_clip_norm <= 0 and self.slots.park(adapter_id, partial(self._step_now, params=params)):
                # Spilled: the step waits with it and is applied when it comes back. Without clipping its
                # metrics need no gradient (`prepare_step`), so they are known now.
                return OptimStepResult(metrics={"learning_rate:mean": params.learning_rate})
            if adapter_id in self.steps or not self.slots.is_resident(adapter_id):
                self.apply_pending_steps()  # its own earlier step, or residency about to change
            state = self.slots.get(adapter_id)
            metrics, ready = prepare_step(state, params)
            if ready:
                self.steps.defer(state, params)
            return OptimStepResult(metrics=metrics)

    def _step_now(self, state: AdapterState, params: AdamParams) -> None:
        """Apply a step parked with a spilled adapter, now that it is back (before anything reads it)."""
        _, ready = prepare_step(state, params)
        if ready:
            self.steps.defer(state, params)
            self.steps.apply_all()

    # -- sampling and checkpoints are added by their own modules ------------------------------------
    def sample(self, works: Sequence[SampleWork]) -> list[SampleResult | WorkError]:
        with self._lock:
            self.apply_pending_steps()
            # Every adapter of the batch stays resident while the others' weights are fetched.
            pinned = {w.adapter_id for w in works if w.adapter_id is not None}

            def weights_for(aid: AdapterId | None) -> LayerWeights:
                if aid is None:
                    return None
                return self.slots.get(aid, pinned=pinned).layer_weights(trainable=False)

            return sample_batch(self.lm, works, weights_for, self._tokenizer, self.limits)

    def save_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> int:
        # Copy under the lock (a consistent adapter), write files outside it (passes carry on).
        with self._lock:
            self.apply_pending_steps()
            state = self.slots.get(adapter_id)
            snap = snapshot(state, base_model=self.info.name, with_optimizer=with_optimizer)
        return write_checkpoint(snap, Path(path))

    def copy_adapter(self, source: AdapterId, target: AdapterId) -> None:
        """`target` := a weights-only copy of `source` for sampling, without the checkpoint files a save and a
        load would write and read (the runtime's `CopyAdapter` uses this when the backend has it)."""
        with self._lock:
            self.apply_pending_steps()
            snap = snapshot(self.slots.get(source), base_model=self.info.name, with_optimizer=False)
            state = build_adapter(snap, target, self.lm.layers, self.lm.device)
            state.sampling_only = True
            self.slots.put(state)

    def load_adapter(self, adapter_id: AdapterId, path: Path, *, with_optimizer: bool) -> LoraSpec:
        # Read and check outside the lock (the layers' shapes never change); only installing needs it.
        snap = read_checkpoint(Path(path), with_optimizer=with_optimizer, base_model=self.info.name)
        state = build_adapter(snap, adapter_id, self.lm.layers, self.lm.device)
        with self._lock:
            self.apply_pending_steps()
            self.slots.put(state)
        return state.spec


def custom_metrics(per_datum: list[dict[str, float]]) -> dict[str, float]:
    """A custom loss's metrics over a request's datums: `:sum` adds up, `:mean` averages (as the SDK's
    client-side `forward_backward_custom` reduces them)."""
    sums: dict[str, float] = {}
    for metrics in per_datum:
        for key, value in metrics.items():
            sums[key] = sums.get(key, 0.0) + value
    return {k: v / len(per_datum) if k.endswith(":mean") else v for k, v in sums.items()}


def _micro_batch_tokens(config: EngineConfig, device: torch.device) -> int:
    chosen = config.micro_batch_tokens
    if chosen is None:
        chosen = CPU_MICRO_BATCH_TOKENS if device.type == "cpu" else config.max_tokens_per_pass
    return max(1, min(chosen, config.max_tokens_per_pass))


def _cut(items: list[PackedItem], budget: int) -> list[list[PackedItem]]:
    batches: list[list[PackedItem]] = []
    current: list[PackedItem] = []
    used = 0
    for item in items:
        n = item.datum.length
        if current and used + n > budget:
            batches.append(current)
            current, used = [], 0
        current.append(item)
        used += n
    if current:
        batches.append(current)
    return batches


def _with_default_weights(datum, loss_fn: str):  # type: ignore[no-untyped-def]
    if loss_fn != "cross_entropy" or "weights" in datum.loss_inputs:
        return datum
    targets = np.asarray(datum.loss_inputs["target_tokens"])
    return replace(datum, loss_inputs={**datum.loss_inputs, "weights": np.ones(targets.shape, np.float32)})
