"""Who is calling: the `Authorization: Bearer <key>` header resolved to a project.

Resolved keys are remembered for a few seconds, so a client polling a batch costs one query per request
rather than two. The price is that a revoked key keeps working for up to `KEY_CACHE_SECONDS`. Unknown keys
are not remembered: a key made a moment ago works at once.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Annotated

from fastapi import Depends, Request
from starlette.concurrency import run_in_threadpool

from jobs.db import SessionFactory
from jobs.errors import ServiceError
from jobs.keys import hash_key, project_for_key_hash

KEY_CACHE_SECONDS = 5.0


@dataclass
class KeyCache:
    """Key hash -> (project id, monotonic expiry). Only touched from the event loop, so it needs no lock."""

    sessions: SessionFactory
    ttl_seconds: float = KEY_CACHE_SECONDS
    _entries: dict[str, tuple[str, float]] = field(default_factory=dict)

    async def project_for(self, secret: str) -> str | None:
        key_hash = hash_key(secret)
        now = time.monotonic()
        cached = self._entries.get(key_hash)
        if cached is not None and cached[1] > now:
            return cached[0]
        project_id = await run_in_threadpool(self._lookup, key_hash)
        if project_id is None:
            self._entries.pop(key_hash, None)
        else:
            self._entries[key_hash] = (project_id, now + self.ttl_seconds)
        return project_id

    def _lookup(self, key_hash: str) -> str | None:
        with self.sessions() as session:
            return project_for_key_hash(session, key_hash)


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
