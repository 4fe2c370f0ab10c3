"""conveyor's inference engine: paged KV cache, iteration-level scheduling, batched sampling.

Knows nothing of HTTP, SQL, Celery or S3.

The names below are imported on first use, so that a process which only needs the engine's
configuration (the API, reading its settings) does not load torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from engine.embedder import Embedder
    from engine.engine_loop import EngineLoop, RequestHandle
    from engine.llm import LLM
    from engine.llm_engine import LLMEngine
    from engine.multimodal.inputs import ImageInput
    from engine.outputs import CompletionOutput, RequestOutput
    from engine.sampling_params import SamplingParams

_MODULE_OF = {
    "Embedder": "engine.embedder",
    "EngineLoop": "engine.engine_loop",
    "RequestHandle": "engine.engine_loop",
    "LLM": "engine.llm",
    "LLMEngine": "engine.llm_engine",
    "ImageInput": "engine.multimodal.inputs",
    "CompletionOutput": "engine.outputs",
    "RequestOutput": "engine.outputs",
    "SamplingParams": "engine.sampling_params",
}

__all__ = list(_MODULE_OF)


def __getattr__(name: str) -> Any:
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
