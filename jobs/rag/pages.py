"""PDF documents read as pages (`RagOptions.pdf_mode = "pages"`): each page rendered to an image and transcribed to
Markdown by the worker's vision-language model; the transcription, not the PDF's text layer, is what is split and
embedded, and passages' offsets point into it.

    transcription = transcribe_pdf(engine, filename, data, options, priority=job.priority, window=64)
    transcription.text           # the transcribed pages, each after a "<!-- page N -->" line
    transcription.page_errors    # [PageError(page, code, message)]: pages that failed; the others went on

Rendering is pypdfium2 (PDFium, the renderer of Chrome; Apache-2.0/BSD, wheels for every platform that bundle the
library): pdf2image would need poppler installed on the host, a system dependency of every worker image, and PyMuPDF
is AGPL. Pages are rendered at `options.page_dpi`, one at a time on the chunk's thread (PDFium is not thread-safe: a
lock serializes the calls of a worker's chunks), and at most `window` pages of a document are in the engine at once: each page's pixels live only until the engine
has preprocessed them, so a 500-page PDF costs `window` pages of memory, not 500.

Every page's prompt is the same: `PAGE_PROMPT` as a system message, then a user turn holding the page's image alone.
Chat templates write the system turn first (LLaVA-1.5's, Qwen2.5-VL's and Gemma 3's alike), so every page's prompt
starts with the same tokens and the engine's prefix cache computes the instructions once per worker, whichever image
follows. Generation is greedy, `options.page_max_tokens` tokens at most per page.

A page that cannot be rendered (`page_unreadable`), whose pixels pass the deployment's image limit
(`page_too_large`), or that the engine refuses or fails (`page_transcription_failed`) is one `PageError`; the other
pages go on. As for an image line, the page's prompt with its image's placeholders and `page_max_tokens` must fit
the model's context. A PDF that cannot be opened at all is a `DocumentError`, as in text mode. An engine that failed whole
(`EngineFailed`) is no page's fault: it is raised, and the chunk goes back to the queue.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

from engine.admission import EngineFailed
from engine.multimodal.inputs import ImageInput
from engine.sampling_params import SamplingParams
from jobs.rag.documents import DocumentError

if TYPE_CHECKING:
    from PIL.Image import Image

    from engine.engine_loop import RequestHandle
    from jobs.rag.processing import RagOptions
    from jobs.run.kinds import EngineHandle

PAGE_PROMPT = (
    "Transcribe the page image that follows to Markdown. Keep the reading order, the headings (as #, ##, ...), "
    "lists, tables (as Markdown tables) and the text of figures' captions; write formulas in LaTeX. "
    "Answer with the transcription alone, without comments."
)
# Bump when rendering, the prompt's chat or the assembly changes: cached transcriptions no longer match a fresh one.
TRANSCRIPTION_VERSION = 1
PageErrorCode = Literal["page_unreadable", "page_too_large", "page_transcription_failed"]
POINTS_PER_INCH = 72  # PDF's unit of page size
# PDFium is not thread-safe, and a worker runs chunks on several threads: every call into it holds this lock (a page's
# rendering, not its wait in the engine).
_PDFIUM_LOCK = threading.Lock()


class TranscriptionStopped(Exception):
    """The job was stopped (cancelled, expired) while its document's pages were transcribed; its pages in the engine
    were aborted."""


@dataclass(frozen=True)
class PageError:
    page: int  # 1-based, as a reader numbers pages
    code: PageErrorCode
    message: str


@dataclass
class Transcription:
    text: str
    pages: int  # pages in the PDF
    page_errors: list[PageError] = field(default_factory=list)
    from_cache: bool = False  # read from the transcription cache, not computed now

    @property
    def transcribed(self) -> int:
        """Pages transcribed: the document goes on to be split and embedded if there is one."""
        return self.pages - len(self.page_errors)


def transcription_cache_key(data: bytes, options: RagOptions, model_name: str) -> str:
    """What a PDF's transcription depends on: its bytes, the page prompt, the rendering, the tokens allowed and the
    model (generation is greedy, so the same inputs give the same text)."""
    settings = {
        "version": TRANSCRIPTION_VERSION, "prompt": PAGE_PROMPT, "dpi": options.page_dpi,
        "max_tokens": options.page_max_tokens, "model": model_name,
    }
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True).encode("utf-8"))
    digest.update(b"\0")
    digest.update(data)
    return digest.hexdigest()


def page_marker(page: int) -> str:
    """The line before a page's transcription: a Markdown comment (invisible when rendered) naming the page, so a
    passage says which page it came from."""
    return f"<!-- page {page} -->"


def assemble(pages: list[tuple[int, str]]) -> str:
    """The transcription of a document: each transcribed page after its marker, a blank line between pages."""
    return "\n\n".join(f"{page_marker(page)}\n{text.strip()}" for page, text in pages)


def page_messages() -> list[dict[str, object]]:
    """The chat of every page: the fixed instructions, then the page's image (`{"type": "image"}`, as transformers
    passes image parts to a template)."""
    return [
        {"role": "system", "content": [{"type": "text", "text": PAGE_PROMPT}]},
        {"role": "user", "content": [{"type": "image"}]},
    ]


def render_pages(filename: str, data: bytes, dpi: int, max_pixels: int) -> Iterator[tuple[int, Image | PageError]]:
    """Each page of the PDF as an RGB image (or why it cannot be), in order, rendered when the caller asks for it.
    A DocumentError, before the first page, when the file is no PDF that PDFium can open."""
    import pypdfium2  # imported on first use: processes that never render a page need no PDFium

    try:
        with _PDFIUM_LOCK:
            pdf = pypdfium2.PdfDocument(data)
            count = len(pdf)
    except pypdfium2.PdfiumError as error:
        if "password" in str(error).lower():
            raise DocumentError(f"{filename}: the PDF is protected by a password; upload it decrypted") from None
        raise DocumentError(f"{filename}: not a readable PDF ({error})") from None
    try:
        for index in range(count):
            with _PDFIUM_LOCK:
                rendered = _render(pdf, index, dpi, max_pixels)
            yield index + 1, rendered
    finally:
        with _PDFIUM_LOCK:
            pdf.close()


def _render(pdf: object, index: int, dpi: int, max_pixels: int) -> Image | PageError:
    import pypdfium2

    assert isinstance(pdf, pypdfium2.PdfDocument)
    number = index + 1
    try:
        page = pdf[index]
    except pypdfium2.PdfiumError as error:
        return PageError(number, "page_unreadable", f"page {number} cannot be read: {error}")
    try:
        width_points, height_points = page.get_size()
        scale = dpi / POINTS_PER_INCH
        width, height = round(width_points * scale), round(height_points * scale)
        if width < 1 or height < 1:
            return PageError(number, "page_unreadable", f"page {number} has no area ({width_points} x {height_points} pt)")
        if width * height > max_pixels:  # checked before a pixel is drawn: a poster-sized page is no bomb
            return PageError(
                number, "page_too_large",
                f"page {number} is {width} x {height} pixels at {dpi} dpi, over the limit of {max_pixels} pixels; "
                f"lower page_dpi",
            )
        return page.render(scale=scale).to_pil().convert("RGB")
    except pypdfium2.PdfiumError as error:
        return PageError(number, "page_unreadable", f"page {number} cannot be rendered: {error}")
    finally:
        page.close()


def transcribe_pdf(
    engine: EngineHandle,
    filename: str,
    data: bytes,
    options: RagOptions,
    *,
    priority: int,
    window: int,
    max_pixels: int,
    stopped: Callable[[], bool],
) -> Transcription:
    """The document's pages transcribed by `engine` (which must read images), at most `window` pages in it at once.
    `stopped` is asked before each page: a long PDF of a cancelled job stops within a page (`TranscriptionStopped`)."""
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(page_messages(), add_generation_prompt=True)
    prompt = tokenizer.encode(text, add_special_tokens=False)  # the template wrote the special tokens
    params = SamplingParams(temperature=0.0, max_tokens=options.page_max_tokens)
    loop = engine.loop
    placer = loop.engine
    transcribed: list[tuple[int, str]] = []
    errors: list[PageError] = []
    in_flight: deque[tuple[int, RequestHandle]] = deque()
    pages = 0

    def collect_oldest() -> None:
        number, handle = in_flight.popleft()
        try:
            transcribed.append((number, handle.result().outputs[0].text))
        except EngineFailed:
            raise
        except Exception as failed:  # refused (ValueError: too long, bad image) or blamed for a failed step
            errors.append(PageError(number, "page_transcription_failed", f"page {number}: {failed}"))

    try:
        for number, rendered in render_pages(filename, data, options.page_dpi, max_pixels):
            pages = number
            if stopped():
                raise TranscriptionStopped(f"{filename}: stopped at page {number}")
            if isinstance(rendered, PageError):
                errors.append(rendered)
                continue
            # The pixels are preprocessed here, on this thread (not the engine's); the engine keeps those, not the image.
            try:
                expanded, placed = placer.place_images(list(prompt), [ImageInput(rendered)])
            except ValueError as refused:  # the model's preprocessing refuses the picture
                errors.append(PageError(number, "page_transcription_failed", f"page {number}: {refused}"))
                continue
            finally:
                del rendered
            if len(expanded) + options.page_max_tokens > placer.max_model_len:
                errors.append(PageError(
                    number, "page_transcription_failed",
                    f"page {number}: its prompt has {len(expanded)} tokens with the image's placeholders and "
                    f"page_max_tokens is {options.page_max_tokens}, more than the model's context of "
                    f"{placer.max_model_len} tokens; lower page_max_tokens or page_dpi",
                ))
                continue
            in_flight.append((number, loop.submit(expanded, params, priority=priority, images=placed)))
            while len(in_flight) >= window:
                collect_oldest()
        while in_flight:
            collect_oldest()
    except BaseException:
        for _, handle in in_flight:  # a failed or interrupted document leaves nothing running in the engine
            if not handle.done():
                loop.abort(handle.request_id)
        raise
    if pages == 0:
        raise DocumentError(f"{filename}: the PDF has no pages")
    transcribed.sort()
    errors.sort(key=lambda error: error.page)
    return Transcription(assemble(transcribed), pages, errors)
