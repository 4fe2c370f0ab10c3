"""/v1/webhooks: register, list, retrieve and delete endpoints, and list each one's deliveries with their attempts."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query

from api.auth import ProjectDep
from api.deps import ReadSessionsDep, SettingsDep, WriteSessionsDep
from api.schemas import (
    CreatedWebhookEndpoint,
    CreateWebhookEndpoint,
    DeletedWebhookEndpoint,
    ListPage,
    WebhookDeliveryObject,
    WebhookEndpointObject,
)
from jobs import webhooks
from jobs.pagination import MAX_PAGE_SIZE
from jobs.webhook_targets import AllowList

router = APIRouter(prefix="/v1/webhooks", tags=["webhooks"])

PageLimit = Annotated[int, Query(ge=1, le=MAX_PAGE_SIZE)]


@router.post("", response_model=CreatedWebhookEndpoint)
def create_webhook(
    body: CreateWebhookEndpoint, sessions: WriteSessionsDep, settings: SettingsDep, project_id: ProjectDep
) -> CreatedWebhookEndpoint:
    allow_list = AllowList.parse(settings.webhook_allowed_hosts)
    with sessions.begin() as session:
        endpoint = webhooks.create_endpoint(
            session, project_id, url=body.url, events=body.events, allow_list=allow_list
        )
    return CreatedWebhookEndpoint.of(endpoint)


@router.get("", response_model=ListPage[WebhookEndpointObject])
def list_webhooks(
    sessions: ReadSessionsDep, project_id: ProjectDep, after: str | None = None, limit: PageLimit = 20
) -> ListPage[WebhookEndpointObject]:
    with sessions() as session:
        page = webhooks.list_endpoints(session, project_id, after=after, limit=limit)
    return ListPage.of([WebhookEndpointObject.of(row) for row in page.rows], page.has_more)


@router.get("/{webhook_id}", response_model=WebhookEndpointObject)
def retrieve_webhook(webhook_id: str, sessions: ReadSessionsDep, project_id: ProjectDep) -> WebhookEndpointObject:
    with sessions() as session:
        return WebhookEndpointObject.of(webhooks.get_endpoint(session, project_id, webhook_id))


@router.delete("/{webhook_id}", response_model=DeletedWebhookEndpoint)
def delete_webhook(webhook_id: str, sessions: WriteSessionsDep, project_id: ProjectDep) -> DeletedWebhookEndpoint:
    with sessions.begin() as session:
        webhooks.delete_endpoint(session, project_id, webhook_id)
    return DeletedWebhookEndpoint(id=webhook_id)


@router.get("/{webhook_id}/deliveries", response_model=ListPage[WebhookDeliveryObject])
def list_webhook_deliveries(
    webhook_id: str,
    sessions: ReadSessionsDep,
    project_id: ProjectDep,
    after: str | None = None,
    limit: PageLimit = 20,
) -> ListPage[WebhookDeliveryObject]:
    with sessions() as session:
        page = webhooks.list_deliveries(session, project_id, webhook_id, after=after, limit=limit)
    return ListPage.of([WebhookDeliveryObject.of(history) for history in page.deliveries], page.has_more)
