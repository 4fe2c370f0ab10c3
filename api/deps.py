"""Dependencies every route shares: a database session, the object store, and the caller's project."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends, Request
from sqlalchemy.orm import Session

from jobs.errors import ServiceError
from jobs.keys import project_for_key
from jobs.settings import Settings
from jobs.storage import ObjectStore


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessions() as session:
        yield session


def get_store(request: Request) -> ObjectStore:
    return request.app.state.store


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def current_project(request: Request, session: Annotated[Session, Depends(get_session)]) -> str:
    """The project of the `Authorization: Bearer <key>` header; every object a route touches must belong to it."""
    scheme, _, secret = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        raise ServiceError(
            "unauthorized",
            "You didn't provide an API key. Send it in the Authorization header as 'Bearer YOUR_KEY' "
            "(`conveyor keys create --project NAME` makes one).",
            code="missing_api_key",
        )
    project_id = project_for_key(session, secret.strip())
    if project_id is None:
        raise ServiceError("unauthorized", "Incorrect API key provided.", code="invalid_api_key")
    return project_id


SessionDep = Annotated[Session, Depends(get_session)]
StoreDep = Annotated[ObjectStore, Depends(get_store)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
ProjectDep = Annotated[str, Depends(current_project)]
