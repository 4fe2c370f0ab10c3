"""The FastAPI application: `create_app(settings)`; `conveyor api` serves it with uvicorn."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI
from starlette.concurrency import run_in_threadpool

from api import batches, files
from api.auth import KeyCache
from api.errors import install_error_handlers
from jobs.db import make_engine, make_session_factory
from jobs.settings import Settings
from jobs.storage import ObjectStore


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings.from_env()
    store = ObjectStore(settings.s3)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await run_in_threadpool(store.ensure_bucket)  # uploads may arrive before any worker has started
        yield

    app = FastAPI(
        lifespan=lifespan,
        title="conveyor",
        summary="OpenAI-compatible batch inference: Files and Batches APIs.",
        version="0.1.0",
    )
    app.state.settings = settings
    app.state.sessions = make_session_factory(make_engine(settings.database_url))
    app.state.keys = KeyCache(app.state.sessions)
    app.state.store = store
    install_error_handlers(app)
    app.include_router(files.router)
    app.include_router(batches.router)
    return app
