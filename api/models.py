"""/v1/models: the models this deployment serves, in OpenAI's shape, under every name a line may give them.

Each name (a served model's id, its further names, and the operator's aliases) is one entry: what a client checks a
name against before writing it into a batch file. The workers announce what they serve (`jobs.served_models`); a
model is listed once a worker serving it has started.
"""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field

from api.auth import ProjectDep
from jobs.errors import ServiceError
from jobs.served_models import OWNED_BY, ModelRegistry, ServedModel, listed_names, parse_aliases
from jobs.settings import Settings

router = APIRouter(prefix="/v1/models", tags=["models"])


class ModelObject(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int  # unix seconds the deployment started serving it
    owned_by: str
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field); None for a base model
    # conveyor's addition: how the model runs; {"quantization": {"method": "int8", "bits": 8, "group_size": 64}}
    # (GGUF: "method": "gguf" and its "tensor_types") when quantized, else {}
    metadata: dict[str, Any] = Field(default_factory=dict)
    # conveyor's addition (the name OpenRouter's model list uses): what its lines may hold; ["text", "image"] for a
    # model that reads images, whose lines may carry image parts (others fail them with `model_not_multimodal`)
    input_modalities: list[Literal["text", "image"]]

    @classmethod
    def of(cls, name: str, model: ServedModel) -> ModelObject:
        return cls(
            id=name, created=model.created, owned_by=OWNED_BY, parent=model.parent, metadata=model.metadata,
            input_modalities=["text", "image"] if model.accepts_images else ["text"],
        )


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelObject]


def _names(request: Request) -> dict[str, ServedModel]:
    registry: ModelRegistry = request.app.state.models
    settings: Settings = request.app.state.settings
    return listed_names(registry.served(), parse_aliases(settings.model_aliases))


@router.get("", response_model=ModelList)
def list_models(request: Request, _: ProjectDep) -> ModelList:
    return ModelList(data=[ModelObject.of(name, model) for name, model in sorted(_names(request).items())])


@router.get("/{model_id:path}", response_model=ModelObject)
def retrieve_model(model_id: str, request: Request, _: ProjectDep) -> ModelObject:
    model = _names(request).get(model_id)
    if model is None:
        raise ServiceError(
            "not_found", f"The model '{model_id}' does not exist or is not served by this deployment",
            param="model", code="model_not_found",
        )
    return ModelObject.of(model_id, model)
