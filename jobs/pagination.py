"""Cursor pagination as OpenAI does it: `after` an object id, `limit` objects, `has_more`.

A page holds Core rows (`jobs.models.plain_columns`), not ORM objects: they read alike, and listings are what
clients poll. Run on a Session or, cheaper, on a plain Connection."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

from sqlalchemy import ColumnElement, Connection, Row, select, tuple_
from sqlalchemy.orm import Session

from jobs.errors import ServiceError
from jobs.models import Batch, File, Schedule, WebhookDelivery, WebhookEndpoint, plain_columns

RowT = TypeVar("RowT", Batch, File, Schedule, WebhookEndpoint, WebhookDelivery)
ItemT = TypeVar("ItemT")  # a page may hold rows paged some other way (a schedule's runs)
MAX_PAGE_SIZE = 100
Order = Literal["asc", "desc"]


@dataclass(frozen=True)
class Page(Generic[ItemT]):
    rows: list[ItemT]
    has_more: bool


def paginate(
    session: Session | Connection,
    model: type[RowT],
    project_id: str,
    *,
    after: str | None,
    limit: int,
    order: Order = "desc",
    filters: Sequence[ColumnElement[bool]] = (),
) -> Page[Row[Any]]:
    """One page of a project's rows ordered by (created_at, id); `after` names the last row of the previous page."""
    owned = model.project_id == project_id
    return paginate_within(session, model, owned, after=after, limit=limit, order=order, filters=filters)


def paginate_within(
    session: Session | Connection,
    model: type[RowT],
    scope: ColumnElement[bool],
    *,
    after: str | None,
    limit: int,
    order: Order = "desc",
    filters: Sequence[ColumnElement[bool]] = (),
) -> Page[Row[Any]]:
    """`paginate` for rows owned through something else (an endpoint's deliveries): `scope` selects the caller's
    rows, the `after` cursor included; `filters` narrow the page only."""
    if not 1 <= limit <= MAX_PAGE_SIZE:
        raise ServiceError("invalid_request", f"limit must be between 1 and {MAX_PAGE_SIZE}", param="limit")
    key: Any = tuple_(model.created_at, model.id)
    query = select(*plain_columns(model)).where(scope, *filters)
    if after is not None:
        cursor = session.execute(select(model.created_at, model.id).where(scope, model.id == after)).first()
        if cursor is None:
            raise ServiceError("not_found", f"no such object to page after: {after!r}", param="after")
        query = query.where(key < tuple_(*cursor) if order == "desc" else key > tuple_(*cursor))
    ordering = (model.created_at.desc(), model.id.desc()) if order == "desc" else (model.created_at, model.id)
    rows = list(session.execute(query.order_by(*ordering).limit(limit + 1)))
    return Page(rows=rows[:limit], has_more=len(rows) > limit)
