"""The generation kind: OpenAI batch lines for `/v1/chat/completions` and `/v1/completions`, run by the engine.

Every line of a chunk is submitted to the worker's `EngineLoop` at once, beside the other run_chunk threads'
requests, so the engine's running batch stays full across chunk, batch and tenant boundaries; then the chunk waits
for all of them, reading its batch's stop flag every `STOP_POLL_SECONDS` and aborting its unfinished requests in
the engine when the batch is cancelled or expires. A request the engine refused or a step blamed on it becomes
its line's error record; an engine that failed (`EngineFailed`) fails the whole chunk, which records nothing, to be
run again by a worker whose engine runs (jobs/tasks.py).

A line with images (`BatchRequest.images`) is not submitted with the others: its images are fetched and decoded on
the chunk's own bounded pool (`jobs.images.prefetch`) while the engine runs the text lines; then its prompt is rendered
with the images and placed (`jobs.images.engine_prompt`, on this chunk's thread) and it joins the engine's batch. A
line whose image fails, whose model reads text only (`model_not_multimodal`), or whose expanded prompt does not fit
gets its error. At most `ImageLimits.lines_in_flight` image lines of a chunk are fetched, decoded or in the engine at
once (`CONVEYOR_IMAGE_LINES_IN_FLIGHT`): each holds its pixels until it finishes; the next waits for one to finish.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING, Any

from engine.admission import EngineFailed
from jobs.batch_limits import BatchLimits
from jobs.images.inputs import ImageLimits
from jobs.images.engine_prompt import locate, place_line
from jobs.images.prefetch import ImagePrefetch, PendingImages, settle_images
from jobs.images.sources import ImageSources, ProjectStore
from jobs.models import Batch
from jobs.openai_format.records import error_record, response_record
from jobs.openai_format.requests import BatchRequest, EmbeddingRequest
from jobs.openai_format.responses import BatchOutputLine
from jobs.openai_format.validation import LineError
from jobs.run.kinds import ChunkResult, EngineHandle
from jobs.run.openai_lines import OpenAILinesKind, expired_record, records_result
from jobs.run.split import LineNumber
from jobs.stop_flags import StopFlags, StopReason
from jobs.storage import ObjectStore
from jobs.webhooks.targets import AllowList

if TYPE_CHECKING:  # the API process imports no engine (nor torch)
    from engine.engine_loop import RequestHandle
    from engine.multimodal.inputs import PlacedImage
    from engine.sampling_params import SamplingParams

log = logging.getLogger(__name__)

# How often a chunk waiting on the engine looks at its batch's stop flag: a cancel reaches the engine this fast.
STOP_POLL_SECONDS = 0.5


class GenerationKind(OpenAILinesKind):
    def __init__(
        self,
        engine: EngineHandle,
        store: ObjectStore,
        stop_flags: StopFlags,
        per_chunk: int,
        limits: BatchLimits,
        image_limits: ImageLimits = ImageLimits(),
        image_allow_list: AllowList = AllowList(frozenset(), ()),
    ) -> None:
        """image_allow_list: `CONVEYOR_IMAGE_ALLOWED_HOSTS`, the hosts image URLs may name although not public."""
        super().__init__(engine, store, per_chunk, limits, image_limits)
        self.stop_flags = stop_flags
        self.image_allow_list = image_allow_list

    def run_chunk(self, batch: Batch, chunk_index: int, lines: Sequence[tuple[LineNumber, bytes]]) -> ChunkResult:
        records, requests = self.checked_lines(batch, lines)
        sources = ImageSources(self.image_limits, self.image_allow_list, ProjectStore(self.store, batch.project_id))
        with ImagePrefetch(sources) as prefetch:
            model = batch.model or self.engine.model_name
            run_id = secrets.token_hex(4)  # keeps request ids unique should a lapsed lease let this chunk run twice
            submitted: list[tuple[BatchRequest, list[RequestHandle] | None]] = []
            submitted += self._submit_text_lines(batch, chunk_index, run_id, requests)
            image_lines = [
                (line_number, request)
                for line_number, request in requests
                if isinstance(request, BatchRequest) and request.images is not None
            ]
            # Image lines are fetched and decoded on the chunk's own threads while the engine runs its text lines.
            window = _ImageWindow(self, batch, chunk_index, run_id, prefetch, model)
            image_records, image_submitted = window.run(image_lines)
            records += image_records
            submitted += image_submitted
        records += self._generation_records(batch.id, model, submitted)
        return records_result(records)

    def _submit(
        self, batch: Batch, chunk_index: int, run_id: str, line_number: LineNumber, request: BatchRequest,
        prompts: list[list[int]], params: SamplingParams, images: tuple[PlacedImage, ...] = (),
    ) -> tuple[BatchRequest, list[RequestHandle]]:
        handles = [
            self.engine.loop.submit(
                prompt,
                params,
                request_id=f"{batch.id}/{chunk_index}/{line_number}/{run_id}/{prompt_index}",
                priority=batch.priority,
                images=images,
            )
            for prompt_index, prompt in enumerate(prompts)
        ]
        return request, handles

    def _submit_text_lines(
        self,
        batch: Batch,
        chunk_index: int,
        run_id: str,
        requests: list[tuple[LineNumber, BatchRequest | EmbeddingRequest]],
    ) -> list[tuple[BatchRequest, list[RequestHandle]]]:
        """Every line without images, submitted to the engine at once."""
        submitted: list[tuple[BatchRequest, list[RequestHandle]]] = []
        for line_number, request in requests:
            assert isinstance(request, BatchRequest)  # the batch's endpoint generates
            if request.images is not None:
                continue
            submitted.append(
                self._submit(batch, chunk_index, run_id, line_number, request, request.prompts, request.sampling_params)
            )
        return submitted

    def _generation_records(
        self, batch_id: str, model: str, submitted: list[tuple[BatchRequest, list[RequestHandle] | None]]
    ) -> list[BatchOutputLine]:
        """The records of the requests submitted to the engine, once all have finished or the batch was stopped (None:
        an image line left unsubmitted when the batch stopped)."""
        stopped, aborted = self._await_or_abort(batch_id, [h for _, handles in submitted for h in handles or ()])
        records: list[BatchOutputLine] = []
        if stopped is None:  # the image window may have seen the batch stopped before every image line was submitted
            stopped = self.stop_flags.reason(batch_id) if any(handles is None for _, handles in submitted) else None
        for request, handles in submitted:
            if handles is None:  # an image line the stopped batch never submitted
                if stopped == StopReason.expired:
                    records.append(expired_record(request.custom_id))
                continue
            if stopped is not None and any(handle.request_id in aborted for handle in handles):
                if stopped == StopReason.expired:  # when cancelled, as OpenAI: only what finished is reported
                    records.append(expired_record(request.custom_id))
                continue
            try:
                results = [handle.result() for handle in handles]
            except EngineFailed:  # not this line's fault: the chunk goes back to the queue whole
                raise
            except ValueError as refused:  # the engine refused the request itself; only this line fails
                records.append(error_record(LineError(request.custom_id, "invalid_parameter", str(refused))))
                continue
            except Exception as failed:  # a step that failed blamed this request (engine/admission.StepFailed)
                records.append(error_record(LineError(request.custom_id, "generation_failed", str(failed))))
                continue
            answered_by = request.sampling_params.adapter or model  # a LoRA adapter's line names the adapter
            records.append(response_record(request, results, model=answered_by, tokenizer=self.engine.tokenizer))
        return records

    def _await_or_abort(self, batch_id: str, handles: list[RequestHandle]) -> tuple[StopReason | None, set[str]]:
        """Wait for every request; if the batch is stopped meanwhile, abort the unfinished ones in the engine and
        return why, with the ids of the requests aborted.

        The chunk does not wait for the aborts to be applied: the engine loop applies them between two steps, and one
        step of many prefill tokens takes seconds on a CPU (tens on a loaded one), which a cancel must not wait for.
        A request that finishes in that step counts as aborted all the same: the client asked for it not to run."""
        unfinished = {handle.future: handle for handle in handles}
        while unfinished:
            _, still_running = wait(unfinished, timeout=STOP_POLL_SECONDS)
            unfinished = {future: unfinished[future] for future in still_running}
            if unfinished and (reason := self.stop_flags.reason(batch_id)) is not None:
                for handle in unfinished.values():
                    self.engine.loop.abort(handle.request_id)
                log.info("batch %s %s: aborted %d requests in the engine", batch_id, reason.value, len(unfinished))
                return reason, {handle.request_id for handle in unfinished.values()}
        return None, set()


class _ImageWindow:
    """A chunk's image lines, in order, with at most `lines_in_flight` of them fetched, decoded or in the engine at
    once: a line's images are fetched when a place opens, and it is submitted once they are read and placed."""

    def __init__(
        self, kind: GenerationKind, batch: Batch, chunk_index: int, run_id: str, prefetch: ImagePrefetch, model: str
    ) -> None:
        self.kind, self.batch, self.chunk_index, self.run_id = kind, batch, chunk_index, run_id
        self.prefetch, self.model = prefetch, model
        self.limit = kind.image_limits.lines_in_flight

    def run(
        self, lines: list[tuple[LineNumber, BatchRequest]]
    ) -> tuple[list[BatchOutputLine], list[tuple[BatchRequest, list[RequestHandle] | None]]]:
        """(the error records of the lines that cannot run, the lines submitted: None for a line left unsubmitted
        because the batch was stopped meanwhile)."""
        engine = self.kind.engine
        waiting = deque(lines)
        fetching: deque[tuple[LineNumber, BatchRequest, PendingImages]] = deque()
        running: set[Future[Any]] = set()  # the submitted image lines' engine requests not finished yet
        records: list[BatchOutputLine] = []
        submitted: list[tuple[BatchRequest, list[RequestHandle] | None]] = []

        def fill() -> None:
            while waiting and len(fetching) + len(running) < self.limit:
                line_number, request = waiting.popleft()
                assert request.images is not None
                fetching.append((line_number, request, self.prefetch.submit(request.images)))

        fill()
        while fetching:
            line_number, request, pending = fetching.popleft()
            line_model = request.sampling_params.adapter or self.model
            settled = settle_images(request.custom_id, pending, line_model, engine.served)
            placed = (
                settled
                if isinstance(settled, LineError)
                else place_line(request, settled, engine.tokenizer, engine.loop.engine, engine.admission_limits)
            )
            del settled, pending  # the decoded images: the placed pixels are what the engine keeps
            if isinstance(placed, LineError):
                records.append(error_record(locate(placed, line_number)))
            else:
                line = self.kind._submit(
                    self.batch, self.chunk_index, self.run_id, line_number, request,
                    [placed.prompt_token_ids], placed.params, placed.images,
                )
                submitted.append(line)
                running.update(handle.future for handle in line[1])
            while waiting and len(fetching) + len(running) >= self.limit:  # wait for a place, watching the stop flag
                _, still = wait(running, timeout=STOP_POLL_SECONDS, return_when=FIRST_COMPLETED)
                running = set(still)
                if self.kind.stop_flags.reason(self.batch.id) is not None:
                    # The lines not submitted are answered as the stopped batch's unfinished ones are.
                    submitted += [(request, None) for _, request, _ in fetching]
                    submitted += [(request, None) for _, request in waiting]
                    return records, submitted
            fill()
        return records, submitted
