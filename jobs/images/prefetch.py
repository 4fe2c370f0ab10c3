"""A chunk's image lines fetched and decoded ahead of the engine, on the chunk's own bounded pool of threads.

The engine's thread never fetches or decodes: a chunk submits its text lines to the engine at once and hands its
image lines' images to an `ImagePrefetch`, whose `fetch_threads` threads fetch and decode them while the engine runs
the other lines. Each image is one task, so a slow server holds one thread for at most the fetch time limit, and the
line it belongs to fails alone, with the error of its first image (in the line's order) that failed.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from types import TracebackType
from typing import TYPE_CHECKING

from jobs.images.decode import decode_image
from jobs.images.inputs import ImageInputs, ImageRejected, LineImages
from jobs.images.sources import ImageSources
from jobs.openai_format.validation import LineError
from jobs.served_models import ModelNames

if TYPE_CHECKING:
    from PIL.Image import Image

log = logging.getLogger(__name__)


class PendingImages:
    """One line's images on their way: `result()` waits for them all, or raises the first that failed."""

    def __init__(self, inputs: ImageInputs, futures: list[Future[Image]]) -> None:
        self._inputs = inputs
        self._futures = futures

    def result(self) -> LineImages:
        images = [future.result() for future in self._futures]  # raises the first failure, in the line's order
        inputs = self._inputs
        return LineImages(inputs.messages, inputs.template_arguments, images, [ref.detail for ref in inputs.refs])


class ImagePrefetch:
    """A bounded pool of fetch-and-decode threads for one chunk; `close` (or leaving `with`) stops it."""

    def __init__(self, sources: ImageSources) -> None:
        self._sources = sources
        self._pool = ThreadPoolExecutor(max_workers=sources.limits.fetch_threads, thread_name_prefix="image-fetch")

    def submit(self, inputs: ImageInputs) -> PendingImages:
        return PendingImages(inputs, [self._pool.submit(self._load, ref.url) for ref in inputs.refs])

    def _load(self, url: str) -> Image:
        try:
            return decode_image(self._sources.fetch(url), self._sources.limits)
        except ImageRejected:
            raise
        except Exception as failure:  # the bulkhead: whatever one image provokes fails its line alone
            log.exception("an image broke its fetch")
            raise ImageRejected("image_fetch_failed", f"the image could not be read: {type(failure).__name__}: {failure}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def __enter__(self) -> ImagePrefetch:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.close()


def settle_images(custom_id: str, pending: PendingImages, model_id: str, served: ModelNames) -> LineError | LineImages:
    """A line's images once read: its error (its first image that failed, or a model that reads text only), else the
    images for the engine. An image line is read in full before its model is asked, so that a hostile image fails
    with its own code whatever model the line names."""
    try:
        images = pending.result()
    except ImageRejected as rejected:
        return LineError(custom_id, rejected.code, rejected.message)
    if not served.accepts_images(model_id):
        return LineError(
            custom_id,
            "model_not_multimodal",
            f"the model {model_id!r} reads text only and this line holds {len(images.images)} image(s); "
            "GET /v1/models lists each model's input_modalities",
        )
    return images
