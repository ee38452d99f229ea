"""The runtime that executes queued work on a base model: command payloads and the scheduler loop.

The control plane enqueues `QueuedRequest`s whose payloads are `commands`; a `SchedulerLoop` per base
model claims them, orders and packs them with the `Scheduler`, runs them on the `Backend` (one backend call
per packed pass, shared by many tenants), and stores, announces and acknowledges the results.
"""

from services.runtime.commands import (
    BarrierCommand,
    CheckpointRecord,
    Command,
    CopyAdapter,
    CreateAdapter,
    ForwardBackward,
    Load,
    OptimStep,
    Sample,
    Save,
)
from services.runtime.loop import LoopConfig, SchedulerLoop
from services.runtime.reporting import CompletionHook, LoopCounters, NullCompletionHook

__all__ = [
    "BarrierCommand",
    "CheckpointRecord",
    "Command",
    "CompletionHook",
    "CopyAdapter",
    "CreateAdapter",
    "ForwardBackward",
    "Load",
    "LoopConfig",
    "LoopCounters",
    "NullCompletionHook",
    "OptimStep",
    "Sample",
    "SchedulerLoop",
    "Save",
]
