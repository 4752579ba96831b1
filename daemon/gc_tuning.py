"""Python's garbage collector tuned for kvloopd's event loop, where every pause is some RPC's latency.

grpcio's asyncio server leaves one reference cycle behind every call (five objects made by its
``_find_method_handler``, with or without interceptors), so with Python's default young-generation
threshold (700) a collection runs every ~140 calls, inside whichever handler allocates next, and
every tenth of them is a middle-generation one: most of Lookup's tail latency. A much higher
threshold makes them rarer; each is longer but lands on a small share of calls, and the garbage it
waits for stays small.

The objects alive once kvloopd's modules are imported, before it serves (modules, classes, gRPC and
protobuf descriptors), never become garbage; ``gc.freeze`` moves them out of every collection, which
makes a full one shorter. The directory's own runs are not frozen: they are freed when dropped.
Figures: docs/benchmarks.md, "Where a Lookup's time goes".
"""

from __future__ import annotations

import gc


def tune_gc(young_threshold: int) -> None:
    """Freeze what is alive now and collect the young generation every ``young_threshold`` objects."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(young_threshold, middle, old)
