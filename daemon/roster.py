"""Route's view of each model's workers, kept for a second.

Route resolves its candidates among the model's registered workers on every call. On Redis, listing them
costs a round trip and a hash per worker, a cost that grows with the fleet and was a large share of
Route's time (docs/benchmarks.md, "Where a Lookup's time goes"). The view is read again after ``ttl_s``
and after any registration, disconnect, resync or drain this replica handles; one made through another
replica reaches it within ``ttl_s``. Until then Route scores that worker as it scores any candidate it
does not know (default estimates): advice a second old at worst, never a wrong answer, since the chosen
prefill's connector judges its pull again with its own Lookup.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from kvloop.daemon.index import WorkerRegistry, WorkerView


class WorkerRoster:
    def __init__(
        self, store: WorkerRegistry, ttl_s: float = 1.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._store = store
        self._ttl_s = ttl_s
        self._clock = clock
        self._views: dict[str, tuple[float, list[WorkerView]]] = {}

    def invalidate(self) -> None:
        self._views.clear()

    async def workers(self, model: str) -> list[WorkerView]:
        """The model's registered workers, as the store listed them at most ``ttl_s`` ago."""
        now = self._clock()
        cached = self._views.get(model)
        if cached is not None and now - cached[0] < self._ttl_s:
            return cached[1]
        views = await self._store.workers(self._store.clock(), model)
        if views:  # a model nobody registered is not kept: requests cannot grow the cache
            self._views[model] = (now, views)
        return views
