"""The control-plane database keeps as many connections open as a gateway process uses at once.

SQLAlchemy's default pool (5 kept, 10 more opened for a burst and closed when returned) made every
transaction past the fifth concurrent one open a fresh connection under load (on SQLite its PRAGMAs, on
PostgreSQL a TCP connect, authentication and a backend process).
"""

from __future__ import annotations

import threading
from pathlib import Path

from sqlalchemy import event, text

from services.db.engine import DEFAULT_POOL_SIZE, make_engine

CONCURRENT = 16
"""The gateway's default blocking threads (gateway/settings.py `blocking_threads`)."""


def _rounds_of_concurrent_transactions(engine, rounds: int) -> list[int]:  # type: ignore[no-untyped-def]
    """Connections opened by each round of `CONCURRENT` threads holding a connection at the same time."""
    opened = [0]
    event.listen(engine, "connect", lambda *_: opened.__setitem__(0, opened[0] + 1))
    per_round = []
    for _ in range(rounds):
        before = opened[0]
        barrier = threading.Barrier(CONCURRENT)

        def work(barrier: threading.Barrier = barrier) -> None:
            with engine.connect() as connection:
                barrier.wait(timeout=30)  # all hold one at once
                connection.execute(text("SELECT 1"))

        threads = [threading.Thread(target=work) for _ in range(CONCURRENT)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        per_round.append(opened[0] - before)
    return per_round


def test_concurrent_transactions_reuse_their_connections(tmp_path: Path) -> None:
    assert DEFAULT_POOL_SIZE >= CONCURRENT
    engine = make_engine(f"sqlite:///{tmp_path / 'pool.db'}")
    try:
        first, second, third = _rounds_of_concurrent_transactions(engine, 3)
    finally:
        engine.dispose()
    assert first == CONCURRENT
    assert (second, third) == (0, 0), "connections of a burst were closed and opened again"


def test_the_pool_size_is_the_callers(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'pool.db'}", pool_size=2, max_overflow=20)
    try:
        first, second = _rounds_of_concurrent_transactions(engine, 2)
    finally:
        engine.dispose()
    assert first == CONCURRENT and second == CONCURRENT - 2  # only two were kept
