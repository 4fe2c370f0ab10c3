"""Who is calling: the `Authorization: Bearer <key>` header resolved to a project.

Resolved keys are remembered for `KEY_CACHE_SECONDS`, so a client polling a batch costs one query per request
rather than two. A revoked key is refused at once all the same: each API process listens for revocations
(`jobs.keys.RevocationListener`, PostgreSQL LISTEN/NOTIFY) and forgets the key, and it caches nothing while it is
not listening (before start-up, while PostgreSQL restarts). Unknown keys are not remembered: a key made a moment
ago works at once.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from jobs.db import SessionFactory
from jobs.errors import ServiceError
from jobs.keys import RevocationListener, hash_key, project_for_key_hash

# Revocations arrive as they happen; this only bounds how long a key revoked behind the service's back (a manual
# UPDATE) keeps working.
KEY_CACHE_SECONDS = 30.0


@dataclass
class KeyCache:
    """Key hash -> (project id, monotonic expiry). Only touched from the event loop (the listener's thread hands
    its news over with `call_soon_threadsafe`), so it needs no lock."""

    sessions: SessionFactory
    database_url: str
    ttl_seconds: float = KEY_CACHE_SECONDS
    _entries: dict[str, tuple[str, float]] = field(default_factory=dict)
    _listening: bool = False
    # Moves with every revocation: a lookup that was in flight across one must not cache what it read before it.
    _generation: int = 0
    _listener: RevocationListener | None = None

    def start(self) -> None:
        """Listen for revocations; caching begins once listening. Call on the event loop (the app's lifespan)."""
        loop = asyncio.get_running_loop()
        self._listener = RevocationListener(
            self.database_url,
            revoked=lambda key_hash: loop.call_soon_threadsafe(self._forget, key_hash),
            listening=lambda listening: loop.call_soon_threadsafe(self._set_listening, listening),
        )
        self._listener.start()

    def stop(self) -> None:
        if self._listener is not None:
            self._listener.stop()

    @property
    def listening(self) -> bool:
        """Whether revocations are heard now, and so keys cached."""
        return self._listening

    async def project_for(self, secret: str) -> str | None:
        return await self.project_for_hash(hash_key(secret))

    async def project_for_hash(self, key_hash: str) -> str | None:
        """The project of the key with this hash (what a console session keeps instead of the key itself)."""
        now = time.monotonic()
        cached = self._entries.get(key_hash)
        if cached is not None and cached[1] > now:
            return cached[0]
        generation = self._generation
        project_id = await run_in_threadpool(self._lookup, key_hash)
        if project_id is not None and self._listening and generation == self._generation:
            self._entries[key_hash] = (project_id, now + self.ttl_seconds)
        else:
            self._entries.pop(key_hash, None)
        return project_id

    def _lookup(self, key_hash: str) -> str | None:
        with self.sessions() as session:
            return project_for_key_hash(session, key_hash)

    def _forget(self, key_hash: str) -> None:
        self._entries.pop(key_hash, None)
        self._generation += 1

    def _set_listening(self, listening: bool) -> None:
        # Either way what is cached may predate a revocation this process did not hear of.
        self._listening = listening
        self._entries.clear()
        self._generation += 1


async def current_project(request: Request) -> str:
    """The caller's project; every object a route touches must belong to it."""
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ServiceError(
            "unauthorized",
            "You didn't provide an API key. Send it in the Authorization header as 'Bearer YOUR_KEY' "
            "(`conveyor keys create --project NAME` makes one).",
            code="missing_api_key",
        )
    project_id = await request.app.state.keys.project_for(secret.strip())
    if project_id is None:
        raise ServiceError("unauthorized", "Incorrect API key provided.", code="invalid_api_key")
    return project_id


ProjectDep = Annotated[str, Depends(current_project)]


async def anthropic_project(request: Request) -> str:
    """The caller's project on Anthropic's paths: the same keys, sent as Anthropic's SDK sends them (`x-api-key`),
    or as a bearer token (the SDK's `auth_token`)."""
    secret = request.headers.get("x-api-key", "").strip()
    if not secret:
        scheme, _, bearer = request.headers.get("authorization", "").partition(" ")
        secret = bearer.strip() if scheme.lower() == "bearer" else ""
    if not secret:
        raise ServiceError(
            "unauthorized",
            "x-api-key header is required (a conveyor project key: `conveyor keys create --project NAME` makes one)",
            code="missing_api_key",
        )
    project_id = await request.app.state.keys.project_for(secret)
    if project_id is None:
        raise ServiceError("unauthorized", "invalid x-api-key", code="invalid_api_key")
    return project_id


AnthropicProjectDep = Annotated[str, Depends(anthropic_project)]
