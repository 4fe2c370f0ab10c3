"""Dependencies every route shares: session factories, the read engine, the object store and the settings; and the
refusal of query parameters a route does not take.

They are `async` so that FastAPI resolves them on the event loop instead of a threadpool hop each. Routes
open their session themselves and close it within the same hop, in one `with` block: a pooled connection
is never held while a request waits for a thread, which under load would deadlock the thread pool
against the connection pool.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from sqlalchemy import Engine

from jobs.db import SessionFactory
from jobs.errors import ServiceError
from jobs.settings import Settings
from jobs.stop_flags import StopFlags
from jobs.storage import ObjectStore


async def get_read_sessions(request: Request) -> SessionFactory:
    return request.app.state.read_sessions


async def get_read_engine(request: Request) -> Engine:
    return request.app.state.read_engine


async def get_write_sessions(request: Request) -> SessionFactory:
    return request.app.state.write_sessions


async def get_store(request: Request) -> ObjectStore:
    return request.app.state.store


async def get_settings(request: Request) -> Settings:
    return request.app.state.settings


async def get_stop_flags(request: Request) -> StopFlags:
    return request.app.state.stop_flags


ReadSessionsDep = Annotated[SessionFactory, Depends(get_read_sessions)]  # one statement per round trip, no transaction
# Core connections, the same pool and autocommit as ReadSessionsDep, for the routes clients poll: Core rows, no ORM.
ReadEngineDep = Annotated[Engine, Depends(get_read_engine)]
WriteSessionsDep = Annotated[SessionFactory, Depends(get_write_sessions)]
StoreDep = Annotated[ObjectStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
StopFlagsDep = Annotated[StopFlags, Depends(get_stop_flags)]


async def reject_unknown_query_parameters(request: Request) -> None:
    """A query parameter the route does not take is refused, not ignored: a misspelt `limit` must not silently
    answer the default page."""
    route = request.scope.get("route")
    if not isinstance(route, APIRoute):
        return
    unknown = sorted(set(request.query_params) - _query_parameters(route.dependant))
    if unknown:
        raise ServiceError("invalid_request", f"unknown query parameter {unknown[0]!r}", param=unknown[0])


def _query_parameters(dependant: Dependant) -> set[str]:
    names = {parameter.alias for parameter in dependant.query_params}
    for sub in dependant.dependencies:
        names |= _query_parameters(sub)
    return names
