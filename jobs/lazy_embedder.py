"""The worker's embedding model: loaded on the first embeddings chunk, then used from one thread of its own.

Most workers never see an embeddings batch, so the model is not loaded at start. Every call runs on a single
embedding thread, which also builds the `Embedder` (as `EngineLoop.build` builds the engine on its own thread:
on CPU, PyTorch's OpenMP team belongs to the thread that first ran a parallel op, and a model built on one
thread and run on another would bring up a second team contending for the same cores). That one thread is also
the lock: the concurrent run_chunk threads' calls queue up and run one forward at a time, and the model is built
once per process, by whichever call comes first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from engine.embedder import Embedder, Embeddings

ResultT = TypeVar("ResultT")


class LazyEmbedder:
    """A `jobs.openai_format.records.TextEmbedder` whose model is built by `make_embedder` on first use."""

    def __init__(self, model_name: str, make_embedder: Callable[[], Embedder]) -> None:
        self.model_name = model_name
        self._make_embedder = make_embedder
        self._embedder: Embedder | None = None  # touched on the embedding thread only
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="embedder")

    @property
    def dimension(self) -> int:
        return self._on_thread(lambda embedder: embedder.dimension)

    def embed(self, texts: Sequence[str]) -> Embeddings:
        return self._on_thread(lambda embedder: embedder.embed(texts))

    def _on_thread(self, call: Callable[[Embedder], ResultT]) -> ResultT:
        return self._thread.submit(lambda: call(self._loaded())).result()

    def _loaded(self) -> Embedder:
        if self._embedder is None:  # a build that raised is tried again by the next call
            self._embedder = self._make_embedder()
        return self._embedder
