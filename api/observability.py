"""Operations endpoints, outside /v1 and without API keys: `/healthz` (the process answers), `/readyz` (PostgreSQL,
Redis and S3 reachable) and `/metrics` (the service's state in Prometheus format)."""

from __future__ import annotations

from dataclasses import asdict

from fastapi import APIRouter, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from redis import Redis

from jobs.celery_app import CONTROL_QUEUE, celery_app
from jobs.served_models import UNROUTED_QUEUE, ModelRegistry, model_queue
from jobs.telemetry.health import PROBE_TIMEOUT_SECONDS, ReadinessProbe
from jobs.telemetry.service_metrics import ServiceCollector
from jobs.settings import Settings

router = APIRouter(tags=["operations"])


def install_observability(app: FastAPI, settings: Settings) -> None:
    """Adds the routes; needs `app.state.read_sessions`."""
    redis = Redis.from_url(
        settings.redis_url, socket_connect_timeout=PROBE_TIMEOUT_SECONDS, socket_timeout=PROBE_TIMEOUT_SECONDS
    )
    models = ModelRegistry(redis, settings.redis_prefix)
    registry = CollectorRegistry()
    registry.register(
        ServiceCollector(
            app.state.read_sessions,
            redis,
            settings.redis_prefix,
            lambda: [UNROUTED_QUEUE, CONTROL_QUEUE, *(model_queue(model.id) for model in models.served())],
            celery_app.conf.broker_transport_options or {},
        )
    )
    ProcessCollector(registry=registry)
    app.state.metrics_registry = registry
    app.state.readiness = ReadinessProbe(app.state.read_sessions, redis, settings.s3)
    app.include_router(router)


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "A backing service is unreachable", "content": {"application/json": {"schema": {}}}}},
)
def readyz(request: Request) -> JSONResponse:
    checks = request.app.state.readiness.check()
    failed = [check.name for check in checks if not check.ok]
    body = {
        "status": "unavailable" if failed else "ready",
        "failed": failed,
        "checks": {check.name: {k: v for k, v in asdict(check).items() if k != "name"} for check in checks},
    }
    return JSONResponse(body, status_code=503 if failed else 200)


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={200: {"description": "Prometheus text exposition format", "content": {"text/plain": {"schema": {"type": "string"}}}}},
)
def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics_registry), media_type=CONTENT_TYPE_LATEST)
