"""Garbage-collector settings of a long-running service process (`carpool serve`, the cluster gateway).

Measured on `bench/load.py` at 512 tenants (a gc callback timing each collection in the server, CPU time of
the collecting thread): CPython's collector took 12 % of the server's CPU, 2-3 % at 8 tenants. Most of it
was full collections: three in 17 s, 0.38 s of CPU each, every thread stopped meanwhile, and each one
found about 60 objects to free. Two things make them frequent and slow at many tenants:

* A full collection runs once 10 middle-generation collections have happened and the objects promoted
  into the oldest generation since the last one reach a quarter of it. A request of a busy service waits
  seconds (a long-poll, a queued `forward_backward`), so its coroutine, scope, futures and parsed body
  outlive the young collections and are promoted: ~30,000 objects a second at 512 tenants, so both
  conditions hold every few seconds.
* Each one traverses every tracked object, ~730,000, of which ~580,000 were created at startup and live
  for ever (modules, classes, functions, the model, the app).

So: after startup the heap is frozen (`gc.freeze()`: those objects move to a permanent generation that
collections skip), and a full collection needs 100 middle-generation collections instead of 10. Young
collections, which free nearly all cyclic garbage here, are unchanged; cyclic garbage that reaches the old
generation lives tens of seconds longer, a few hundred objects.
"""

from __future__ import annotations

import gc

FULL_COLLECTION_EVERY = 100
"""Middle-generation collections between two full ones (CPython's default: 10)."""


def tune_collector() -> None:
    """Freeze what startup built and space full collections out; call once, right before serving."""
    gc.collect()  # what startup left as garbage goes now, not into the permanent generation
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)
