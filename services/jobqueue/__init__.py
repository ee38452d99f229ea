"""The queue, result store and notifier between gateway and scheduler: Protocols and in-process versions."""

from services.jobqueue.memory import InMemoryNotifier, InMemoryResultStore, InMemoryWorkQueue
from services.jobqueue.protocol import (
    DEFAULT_RESULT_TTL_S,
    Delivery,
    Notifier,
    ResultStatus,
    ResultStore,
    StoredResult,
    WorkQueue,
)

__all__ = [
    "DEFAULT_RESULT_TTL_S",
    "Delivery",
    "InMemoryNotifier",
    "InMemoryResultStore",
    "InMemoryWorkQueue",
    "Notifier",
    "ResultStatus",
    "ResultStore",
    "StoredResult",
    "WorkQueue",
]
