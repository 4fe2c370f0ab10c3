"""The API's key cache against real PostgreSQL, in process: a polling client's key is looked up once, and a revoked
key is refused as soon as the revocation commits, long before the cache entry would expire."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable

import pytest
from sqlalchemy.orm import Session

from api import auth
from api.auth import KeyCache
from jobs.db import make_engine, make_session_factory
from jobs.keys import create_key_in_database, revoke_key


async def eventually(condition: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> float:
    """Seconds until the async `condition()` held."""
    start = time.monotonic()
    while not await condition():
        assert time.monotonic() - start < timeout_s, "condition never held"
        await asyncio.sleep(0.01)
    return time.monotonic() - start


def test_a_cached_key_is_refused_as_soon_as_it_is_revoked(database_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    created = create_key_in_database(database_url, f"key-cache-{secrets.token_hex(4)}")
    lookups: list[str] = []
    real_lookup = auth.project_for_key_hash

    def counted_lookup(session: Session, key_hash: str) -> str | None:
        lookups.append(key_hash)
        return real_lookup(session, key_hash)

    monkeypatch.setattr(auth, "project_for_key_hash", counted_lookup)
    engine = make_engine(database_url, pool_size=2)
    sessions = make_session_factory(engine, read_only=True)

    async def scenario() -> None:
        cache = KeyCache(sessions, database_url, ttl_seconds=3600)
        assert await cache.project_for(created.secret) == created.project_id  # not listening yet: not cached
        cache.start()

        async def listening() -> bool:
            return cache.listening

        async def refused() -> bool:
            return await cache.project_for(created.secret) is None

        try:
            await eventually(listening)
            for _ in range(3):
                assert await cache.project_for(created.secret) == created.project_id
            assert len(lookups) == 2  # one before listening, one for the three polls

            with make_session_factory(engine).begin() as session:
                assert revoke_key(session, created.key_id)
            assert await eventually(refused) < 2.0  # the notification, not the hour-long expiry
        finally:
            cache.stop()

    try:
        asyncio.run(scenario())
        with make_session_factory(engine).begin() as session:
            assert not revoke_key(session, created.key_id)  # revoked once
    finally:
        engine.dispose()
