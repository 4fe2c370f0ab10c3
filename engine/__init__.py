"""conveyor's inference engine: paged KV cache, iteration-level scheduling, batched sampling.

Knows nothing of HTTP, SQL, Celery or S3.
"""

from engine.engine_loop import EngineLoop, RequestHandle
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineLoop", "RequestHandle", "SamplingParams", "RequestOutput", "CompletionOutput"]
