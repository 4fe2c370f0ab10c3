"""The FastAPI application: `create_app(settings)`; `conveyor api` serves it with uvicorn."""

from __future__ import annotations

import gc
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI
from redis import Redis
from starlette.concurrency import run_in_threadpool

from api import batches, files, message_batches, models, rag, schedules, webhooks
from api.auth import KeyCache
from api.console import install_console
from api.deps import reject_unknown_query_parameters
from api.errors import install_error_handlers
from api.observability import install_observability
from api.openapi import install_openapi
from jobs.db import autocommit, make_engine, make_session_factory
from jobs.served_models import ModelRegistry
from jobs.settings import Settings
from jobs.stop_flags import StopFlags
from jobs.storage import ObjectStore

ROUTE_THREADS = 40  # anyio's default thread limiter, which runs FastAPI's sync routes and dependencies


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    store = ObjectStore(settings.s3)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(store.ensure_bucket)  # uploads may arrive before any worker has started
        app.state.keys.start()
        # What exists now (modules, the app) lives as long as the process. Frozen, it is left out of
        # garbage collection, whose full passes would otherwise stall every request for ~0.1 s.
        gc.collect()
        gc.freeze()
        try:
            yield
        finally:
            app.state.keys.stop()

    app = FastAPI(
        lifespan=lifespan,
        dependencies=[Depends(reject_unknown_query_parameters)],
        title="conveyor",
        summary="OpenAI-compatible batch inference: Files and Batches APIs.",
        version="0.1.0",
    )
    app.state.settings = settings
    # No pre-ping: a poll is one round trip. After a Postgres restart the first request on a dead
    # connection answers 500 (which the SDKs retry) and the pool reconnects. A connection kept for each
    # thread that runs routes, so that under load none is closed and reopened between requests.
    database = make_engine(settings.database_url, pool_size=ROUTE_THREADS, pre_ping=False)
    app.state.read_engine = autocommit(database)
    app.state.read_sessions = make_session_factory(database, read_only=True)
    app.state.write_sessions = make_session_factory(database)
    app.state.keys = KeyCache(app.state.read_sessions, settings.database_url)
    app.state.store = store
    redis = Redis.from_url(settings.redis_url)
    app.state.stop_flags = StopFlags(redis, settings.redis_prefix)
    app.state.models = ModelRegistry(redis, settings.redis_prefix)
    install_error_handlers(app)
    app.include_router(models.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(message_batches.router)
    app.include_router(webhooks.router)
    app.include_router(schedules.router)
    app.include_router(rag.router)
    install_console(app, redis, settings.redis_prefix)
    install_observability(app, settings)
    install_openapi(app)
    return app
