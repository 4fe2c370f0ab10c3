"""Every endpoint format conveyor serves, by the url its lines carry."""

from __future__ import annotations

from jobs.formats.anthropic_messages import AnthropicMessages
from jobs.formats.base import EndpointFormat, GenerationFormat
from jobs.formats.chat_completions import ChatCompletions
from jobs.formats.completions import Completions
from jobs.formats.embeddings import Embeddings
from jobs.formats.responses import Responses
from jobs.served_models import ModelKind

GENERATION_FORMATS: dict[str, GenerationFormat] = {
    generating.url: generating for generating in (ChatCompletions(), Completions(), Responses(), AnthropicMessages())
}
FORMATS: dict[str, EndpointFormat] = {**GENERATION_FORMATS, Embeddings.url: Embeddings()}
# Which kind of served model answers an endpoint's lines
MODEL_KINDS: dict[str, ModelKind] = {url: endpoint_format.model_kind for url, endpoint_format in FORMATS.items()}
