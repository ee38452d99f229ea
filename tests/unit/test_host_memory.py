"""CPU engines keep freed memory for reuse: glibc accepts the settings, and a preloaded allocator is left alone."""

from __future__ import annotations

import platform
import resource

import pytest
import torch

from tests.required import missing
from worker.engine import host_memory


def test_preloaded_allocator_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(host_memory, "_tuned", False)
    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2")
    assert host_memory.keep_freed_memory() is False
    assert host_memory._tuned is False


def test_glibc_keeps_big_buffers_for_reuse(monkeypatch: pytest.MonkeyPatch) -> None:
    if platform.libc_ver()[0] != "glibc":
        missing("glibc", f"this Python runs on {platform.libc_ver()[0] or 'an unknown C library'}",
                "run the suite on a glibc system (the tuning is glibc's mallopt)")
    monkeypatch.setattr(host_memory, "_tuned", False)
    monkeypatch.delenv("LD_PRELOAD", raising=False)
    assert host_memory.keep_freed_memory() is True  # on glibc the tuning call must succeed
    assert host_memory.keep_freed_memory() is True  # idempotent
    # A 64 MB buffer (above any mmap threshold) allocated and freed over and over, as passes do. The first
    # few land on fresh heap (an aligned request is a little larger than the hole the last one left), after
    # which freed ones are reused: touching ten more faults (almost) nothing in. Untuned, each one is
    # mmapped afresh: 16,384 faults apiece.
    for _ in range(12):
        torch.ones(16 << 20)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.ones(16 << 20)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before < 1000
