"""The web console: server-rendered pages under /console over the services the JSON routes use, for the project
of the API key a person signed in with (`sessions.py`). `install_console(app)` adds it to the API's app: `home.py`
(sign-in, sign-out, overview), `batches.py` (batches and RAG jobs), `resources.py` (files, schedules, webhooks,
models, workers), their templates and the static CSS and script."""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles
from redis import Redis

from api.console import batches, home, resources
from api.console.rendering import PACKAGE
from api.console.sessions import ConsoleSessions


def install_console(app: FastAPI, redis: Redis, redis_prefix: str) -> None:
    app.state.redis = redis
    app.state.console_sessions = ConsoleSessions(redis, redis_prefix)
    app.include_router(home.router)
    app.include_router(batches.router)
    app.include_router(resources.router)
    app.mount("/console/static", StaticFiles(directory=PACKAGE / "static"), name="console-static")
