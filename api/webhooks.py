"""Webhook endpoints: register, list, retrieve, update, rotate the secret of and delete them, and list each one's
deliveries with their attempts.

Served at OpenAI's path, /v1/webhook_endpoints, so `OpenAI().webhooks.create(...)` and the rest work unchanged,
and at /v1/webhooks, the path this API was first specified with: one set of routes, included under both.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import ProjectDep
from api.deps import ReadSessionsDep, SettingsDep, WriteSessionsDep
from api.schemas import (
    CreateWebhookEndpoint,
    DeletedWebhookEndpoint,
    ListPage,
    RotateWebhookSecret,
    UpdateWebhookEndpoint,
    WebhookDeliveryObject,
    WebhookEndpointObject,
    WebhookEndpointWithSecret,
)
from jobs.webhooks import endpoints
from jobs.errors import ServiceError
from jobs.pagination import MAX_PAGE_SIZE
from jobs.webhooks.targets import AllowList

PREFIXES = ("/v1/webhook_endpoints", "/v1/webhooks")

endpoint_routes = APIRouter()

PageLimit = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)]


@endpoint_routes.post("", response_model=WebhookEndpointWithSecret)
def create_webhook(
    body: CreateWebhookEndpoint, sessions: WriteSessionsDep, settings: SettingsDep, project_id: ProjectDep
) -> WebhookEndpointWithSecret:
    allow_list = AllowList.parse(settings.webhook_allowed_hosts)
    with sessions.begin() as session:
        endpoint = endpoints.create_endpoint(
            session, project_id, url=body.url, name=body.name, events=body.event_types, allow_list=allow_list
        )
    return WebhookEndpointWithSecret.of(endpoint)


@endpoint_routes.get("", response_model=ListPage[WebhookEndpointObject])
def list_webhooks(
    sessions: ReadSessionsDep, project_id: ProjectDep, after: str | None = None, limit: PageLimit = 20
) -> ListPage[WebhookEndpointObject]:
    with sessions() as session:
        page = endpoints.list_endpoints(session, project_id, after=after, limit=limit)
    return ListPage.of([WebhookEndpointObject.of(row) for row in page.rows], page.has_more)


@endpoint_routes.get("/{webhook_id}", response_model=WebhookEndpointObject)
def retrieve_webhook(webhook_id: str, sessions: ReadSessionsDep, project_id: ProjectDep) -> WebhookEndpointObject:
    with sessions() as session:
        return WebhookEndpointObject.of(endpoints.get_endpoint(session, project_id, webhook_id))


@endpoint_routes.post("/{webhook_id}", response_model=WebhookEndpointObject)
def update_webhook(
    webhook_id: str,
    body: UpdateWebhookEndpoint,
    sessions: WriteSessionsDep,
    settings: SettingsDep,
    project_id: ProjectDep,
) -> WebhookEndpointObject:
    allow_list = AllowList.parse(settings.webhook_allowed_hosts)
    with sessions.begin() as session:
        endpoint = endpoints.update_endpoint(
            session,
            project_id,
            webhook_id,
            url=body.url,
            name=body.name,
            events=body.event_types,
            allow_list=allow_list,
        )
    return WebhookEndpointObject.of(endpoint)


@endpoint_routes.post("/{webhook_id}/rotate_secret", response_model=WebhookEndpointWithSecret)
def rotate_webhook_secret(
    webhook_id: str, sessions: WriteSessionsDep, project_id: ProjectDep, body: RotateWebhookSecret | None = None
) -> WebhookEndpointWithSecret:
    if body is not None and body.keep_old_secret_active_for_24_hours:
        # Signing with two secrets for a day would need the old one stored and expired; not built yet.
        raise ServiceError(
            "invalid_request",
            "keep_old_secret_active_for_24_hours is not supported: the old secret stops signing at once",
            param="keep_old_secret_active_for_24_hours",
        )
    with sessions.begin() as session:
        endpoint = endpoints.rotate_secret(session, project_id, webhook_id)
    return WebhookEndpointWithSecret.of(endpoint)


@endpoint_routes.delete("/{webhook_id}", response_model=DeletedWebhookEndpoint)
def delete_webhook(webhook_id: str, sessions: WriteSessionsDep, project_id: ProjectDep) -> DeletedWebhookEndpoint:
    with sessions.begin() as session:
        endpoints.delete_endpoint(session, project_id, webhook_id)
    return DeletedWebhookEndpoint(id=webhook_id)


@endpoint_routes.get("/{webhook_id}/deliveries", response_model=ListPage[WebhookDeliveryObject])
def list_webhook_deliveries(
    webhook_id: str,
    sessions: ReadSessionsDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: PageLimit = 20,
) -> ListPage[WebhookDeliveryObject]:
    with sessions() as session:
        page = endpoints.list_deliveries(session, project_id, webhook_id, after=after, limit=limit)
    return ListPage.of([WebhookDeliveryObject.of(history) for history in page.deliveries], page.has_more)


# Last: older FastAPI releases (pyproject allows >=0.115) copy a router's routes when it is included.
router = APIRouter(tags=["webhooks"])
for prefix in PREFIXES:
    router.include_router(endpoint_routes, prefix=prefix)
