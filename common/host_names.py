"""How the host retention tier names what it serves, for every side that names it: the connector's
scheduler and worker halves, the sidecar, kvloopd's tools and the benchmarks (no torch or vLLM here).

A decode's host pool is served as an engine of its own, ``<engine id>@host``; a run's copy there is
announced as ``<request id>@host``; a request's window capture (a hybrid model's sliding-window blocks,
copied while it decodes) is ``<request id>@window``."""

from __future__ import annotations

HOST_SUFFIX = "@host"
WINDOW_SUFFIX = "@window"


def host_engine_id(engine_id: str) -> str:
    """The engine id a decode's host pool is served under."""
    return f"{engine_id}{HOST_SUFFIX}"
