"""Pools of vLLM servers (prefill or decode) with health checks and in-flight counts."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

import aiohttp
import structlog

log = structlog.get_logger("kvloop.proxy")


@dataclass(eq=False)
class Backend:
    url: str
    role: str
    healthy: bool = False
    in_flight: int = 0
    # Prompt tokens the in-flight requests compute here, as the proxy estimated them (Route's input).
    queued_tokens: int = 0
    last_error: str = ""
    models: list[str] = field(default_factory=list)
    # Served model name -> the model's path or Hugging Face id as the server loaded it (`root`).
    roots: dict[str, str] = field(default_factory=dict)
    # The server's /v1/models entries as it wrote them (max_model_len, root, parent, permission).
    cards: list[dict] = field(default_factory=list)
    # The key the server was started with (`vllm serve --api-key`); never logged.
    api_key: str = field(default="", repr=False)

    def headers(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Headers for a request to this server: `extra` and its API key."""
        out = dict(extra or {})
        if self.api_key:
            out["Authorization"] = f"Bearer {self.api_key}"
        return out


class NoBackend(Exception):
    """No healthy backend of a role: the proxy answers 503 with this message."""


class BackendPool:
    def __init__(self, role: str, urls: list[str], health_interval_s: float = 2.0, api_key: str = "") -> None:
        self.role = role
        self.backends = [Backend(u.rstrip("/"), role, api_key=api_key) for u in urls]
        self.health_interval_s = health_interval_s
        # Called with a backend when its served models are first known (its /v1/models answered):
        # at start-up, or at a later check when the server was not up or too slow then.
        self.on_models: Callable[[Backend], None] | None = None
        self._rr = 0

    def by_url(self, url: str) -> Backend | None:
        url = url.rstrip("/")
        return next((b for b in self.backends if b.url == url), None)

    def pick(self, prefer: Backend | None = None, among: list[Backend] | None = None) -> Backend:
        """Least in-flight healthy backend (round-robin among ties), of `among` when given; `prefer`
        wins when healthy."""
        if prefer is not None and prefer.healthy:
            return prefer
        healthy = [b for b in (self.backends if among is None else among) if b.healthy]
        if not healthy:
            detail = "; ".join(f"{b.url}: {b.last_error or 'not checked yet'}" for b in self.backends)
            raise NoBackend(f"no healthy {self.role} server ({detail})")
        self._rr += 1
        least = min(b.in_flight for b in healthy)
        ties = [b for b in healthy if b.in_flight == least]
        return ties[self._rr % len(ties)]

    async def check(self, session: aiohttp.ClientSession, backend: Backend) -> None:
        try:
            async with session.get(f"{backend.url}/health", timeout=aiohttp.ClientTimeout(total=3)) as r:
                ok = r.status == 200
                backend.last_error = "" if ok else f"/health answered {r.status}"
            if ok and not backend.models:
                async with session.get(
                    f"{backend.url}/v1/models",
                    headers=backend.headers(),
                    timeout=aiohttp.ClientTimeout(total=3),
                ) as r:
                    if r.status == 401:  # every request would be refused: not one to send them to
                        ok = False
                        backend.last_error = "/v1/models answered 401: wrong key for this server"
                    elif r.status == 200:
                        served = (await r.json()).get("data", [])
                        backend.cards = [m for m in served if isinstance(m, dict)]
                        backend.models = [m["id"] for m in served]
                        backend.roots = {m["id"]: m["root"] for m in served if m.get("root")}
                        if self.on_models is not None:
                            self.on_models(backend)
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            ok = False
            backend.last_error = f"unreachable: {exc.__class__.__name__}: {exc}"
        if ok != backend.healthy:
            log.info(
                "backend health changed",
                role=self.role,
                url=backend.url,
                healthy=ok,
                error=backend.last_error,
            )
        backend.healthy = ok

    async def check_all(self, session: aiohttp.ClientSession) -> None:
        await asyncio.gather(*(self.check(session, b) for b in self.backends))

    async def keep_checking(self, session: aiohttp.ClientSession) -> None:
        while True:
            await self.check_all(session)
            await asyncio.sleep(self.health_interval_s)

    def mark_failed(self, backend: Backend, error: str) -> None:
        """Out of the pool until its health check passes again (the next check, every
        `health_interval_s`: a server restarted on the same address comes back by itself)."""
        if backend.healthy:
            log.warning("backend marked failed", role=self.role, url=backend.url, error=error)
        backend.healthy = False
        backend.last_error = error
