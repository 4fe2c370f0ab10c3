"""Dependencies every route shares: session factories, the object store and the settings.

They are `async` so that FastAPI resolves them on the event loop instead of a threadpool hop each. Routes
open their session themselves and close it within the same hop, in one `with` block: a pooled connection
is never held while a request waits for a thread, which under load would deadlock the thread pool
against the connection pool.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from jobs.db import SessionFactory
from jobs.settings import Settings
from jobs.stop_flags import StopFlags
from jobs.storage import ObjectStore


async def get_read_sessions(request: Request) -> SessionFactory:
    return request.app.state.read_sessions


async def get_write_sessions(request: Request) -> SessionFactory:
    return request.app.state.write_sessions


async def get_store(request: Request) -> ObjectStore:
    return request.app.state.store


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_stop_flags(request: Request) -> StopFlags:
    return request.app.state.stop_flags


ReadSessionsDep = Annotated[SessionFactory, Depends(get_read_sessions)]  # one statement per round trip, no transaction
WriteSessionsDep = Annotated[SessionFactory, Depends(get_write_sessions)]
StoreDep = Annotated[ObjectStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StopFlagsDep = Annotated[StopFlags, Depends(get_stop_flags)]
