"""The gateway's decode pool: large or compressed `forward_backward` bodies are decoded on its threads, a
training step's small uncompressed body on the event loop (the hop to a thread and back cost more)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from gateway.edge_limits import INLINE_DECODE_BYTES, DecodePool, decodes_inline


@pytest.mark.parametrize(("size", "encoding", "inline"), [
    (600, None, True),  # the SDK's step of one 32-token sequence
    (INLINE_DECODE_BYTES, "", True),
    (INLINE_DECODE_BYTES + 1, None, False),  # a batch of many sequences
    (600, "zstd", False),  # its decoded size is unknown until it is inflated
])
def test_only_small_uncompressed_bodies_decode_inline(size: int, encoding: str | None, inline: bool) -> None:
    assert decodes_inline(b"x" * size, encoding) is inline


def test_inline_runs_on_the_callers_thread_and_the_rest_on_a_decode_thread() -> None:
    pool = DecodePool(threads=1)

    async def where(inline: bool) -> str:
        return await pool.run(lambda: threading.current_thread().name, inline=inline)

    async def both() -> tuple[str, str, str]:
        return threading.current_thread().name, await where(True), await where(False)

    try:
        caller, inline, pooled = asyncio.run(both())
    finally:
        pool.shutdown()
    assert inline == caller
    assert pooled.startswith("carpool-decode") and pooled != caller
