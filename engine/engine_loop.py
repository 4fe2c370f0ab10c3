"""A thread-safe front for LLMEngine: one thread steps the engine while others submit and abort.

Only the loop thread touches the engine. Other threads hand it commands through a queue guarded
by a condition variable, so a submit never waits for a step to finish, and the loop sleeps only
when there is nothing at all to do. This is how one GPU worker feeds a single engine from many
concurrent tasks, keeping the running batch full across task boundaries.

An engine that can never step again (`EngineFailed`: a tensor-parallel rank died, noticed by a step or, while
idle, by a health check every `HEALTH_CHECK_SECONDS`) ends the loop: `on_failure` is called first (the worker
stops taking work), then every request in flight or queued fails with that error, and so does every later
submit or stats call. `failure` holds it.
"""

from __future__ import annotations

import itertools
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from dataclasses import dataclass

from engine.admission import EngineFailed, StepFailed
from engine.llm_engine import LLMEngine
from engine.metrics import EngineStats
from engine.multimodal.inputs import ImageInput, PlacedImage
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams

_END_OF_STREAM = None
# How often an idle loop asks the engine whether it can still step: a dead rank is noticed this fast with no work.
HEALTH_CHECK_SECONDS = 1.0


class RequestHandle:
    """What `submit` returns: `result()` blocks for the final output; iterating yields snapshots
    as tokens arrive (streaming requests) and ends with the final one."""

    def __init__(self, request_id: str, stream: bool) -> None:
        self.request_id = request_id
        self.future: Future[RequestOutput] = Future()
        self._stream: queue.Queue[RequestOutput | None] | None = queue.Queue() if stream else None

    def result(self, timeout: float | None = None) -> RequestOutput:
        return self.future.result(timeout)

    def done(self) -> bool:
        return self.future.done()

    def __iter__(self) -> Iterator[RequestOutput]:
        if self._stream is None:
            yield self.result()
            return
        while (item := self._stream.get()) is not _END_OF_STREAM:
            yield item
        self.future.result()  # re-raises if the request failed

    def _publish(self, output: RequestOutput) -> None:
        if self._stream is not None:
            self._stream.put(output)
        if output.finished:
            self._close()
            self.future.set_result(output)

    def _fail(self, error: BaseException) -> None:
        self._close()
        self.future.set_exception(error)

    def _close(self) -> None:
        if self._stream is not None:
            self._stream.put(_END_OF_STREAM)


@dataclass(frozen=True)
class _Submit:
    handle: RequestHandle
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    images: tuple[PlacedImage, ...] = ()  # placed in prompt_token_ids on the submitting thread


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _ReadStats:
    answer: Future[EngineStats]


class EngineLoop:
    def __init__(self, engine: LLMEngine, on_failure: Callable[[EngineFailed], None] | None = None) -> None:
        self.engine = engine
        self._commands: list[_Submit | _Abort | _ReadStats] = []
        self._wakeup = threading.Condition()
        self._handles: dict[str, RequestHandle] = {}
        self._ids = itertools.count()
        self._stopping = False
        self._on_failure = on_failure
        self.failure: EngineFailed | None = None  # set once, when the engine can no longer step
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)

    def start(self) -> "EngineLoop":
        self._thread.start()
        return self

    @classmethod
    def build(
        cls, make_engine: Callable[[], LLMEngine], on_failure: Callable[[EngineFailed], None] | None = None
    ) -> "EngineLoop":
        """A started loop whose engine was constructed on the loop thread itself; an error while
        building is raised here. On CPU, PyTorch's OpenMP worker team belongs to the thread that first
        ran a parallel op: an engine loaded on one thread and stepped on another runs two teams that
        contend for the same cores."""
        built: Future[EngineLoop] = Future()

        def build_then_run() -> None:
            try:
                loop = cls(make_engine(), on_failure)
            except BaseException as error:
                built.set_exception(error)
                return
            loop._thread = threading.current_thread()
            built.set_result(loop)
            loop._run()

        threading.Thread(target=build_then_run, name="engine-loop", daemon=True).start()
        return built.result()

    def stop(self) -> None:
        """Abort whatever is still in flight (callers get finish_reason 'abort'), join the thread and close the
        engine (its other tensor-parallel ranks, if any)."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join()
        self.engine.close()

    def __enter__(self) -> "EngineLoop":
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        stream: bool = False,
        images: tuple[ImageInput | PlacedImage, ...] = (),
    ) -> RequestHandle:
        """Queue a request; `images` as LLMEngine.add_request takes them, preprocessed here on the caller's thread
        (never on the loop's, which would stall every other request's step). A request that cannot run fails its own
        handle."""
        handle = RequestHandle(request_id or f"loop-{next(self._ids)}", stream)
        placed: tuple[PlacedImage, ...] = ()
        if images:  # a text prompt's check stays on the loop (cheap: no pixels)
            try:
                prompt_token_ids, placed = self.engine.place_images(list(prompt_token_ids), images)
            except ValueError as error:
                handle._fail(error)
                return handle
        with self._wakeup:
            if self.failure is not None:
                raise self.failure
            if self._stopping:
                raise RuntimeError("the engine loop is stopped")
            self._commands.append(_Submit(handle, list(prompt_token_ids), params, priority, placed))
            self._wakeup.notify()
        return handle

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._commands.append(_Abort(request_id))
            self._wakeup.notify()

    def stats(self, timeout: float | None = None) -> EngineStats:
        """The engine's stats, taken by the loop thread between two steps: the engine's queues and pools are
        only consistent there. Waits for the step in progress, if any."""
        answer: Future[EngineStats] = Future()
        with self._wakeup:
            if self.failure is not None:
                raise self.failure
            if self._stopping:
                raise RuntimeError("the engine loop is stopped")
            self._commands.append(_ReadStats(answer))
            self._wakeup.notify()
        return answer.result(timeout)

    @property
    def num_in_flight(self) -> int:
        return len(self._handles)

    def _run(self) -> None:
        try:
            self._serve()
        except EngineFailed as failure:
            self._fail_everything(failure)

    def _serve(self) -> None:
        while True:
            with self._wakeup:
                while not self._commands and not self.engine.has_unfinished_requests() and not self._stopping:
                    if not self._wakeup.wait(HEALTH_CHECK_SECONDS):
                        self.engine.check_health()
                commands, self._commands = self._commands, []
                stopping = self._stopping
            for command in commands:
                self._apply(command)
            if stopping:
                for request_id in list(self._handles):
                    self._apply(_Abort(request_id))
                return
            if self.engine.has_unfinished_requests():
                self._step()

    def _apply(self, command: _Submit | _Abort | _ReadStats) -> None:
        if isinstance(command, _ReadStats):
            try:
                command.answer.set_result(self.engine.stats())
            except Exception as error:  # the reader gets the error; the loop thread must live on
                command.answer.set_exception(error)
            return
        if isinstance(command, _Abort):
            output = self.engine.abort_request(command.request_id)
            handle = self._handles.pop(command.request_id, None)
            if handle is not None and output is not None:
                handle._publish(output)
            return
        handle = command.handle
        try:
            self.engine.add_request(
                handle.request_id, command.prompt_token_ids, command.params, command.priority,
                stream=handle._stream is not None, images=command.images,
            )
        except Exception as error:  # a bad request (ValueError, or TypeError for a malformed prompt)
            handle._fail(error)  # fails its own handle only: letting it escape would kill the loop thread
            return
        self._handles[handle.request_id] = handle

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except StepFailed as failed:  # blame the costliest request of the step; the next step retries the rest
            self.engine.abort_request(failed.request_id)
            handle = self._handles.pop(failed.request_id, None)
            if handle is not None:
                handle._fail(failed)
            return
        except EngineFailed:
            raise  # ends the loop (_run)
        except Exception as error:  # a step that failed outside any request must not hang every caller
            for request_id, handle in list(self._handles.items()):
                self.engine.abort_request(request_id)
                handle._fail(error)
            self._handles.clear()
            return
        for output in outputs:
            handle = self._handles.get(output.request_id)
            if handle is None:
                continue
            if output.finished:
                del self._handles[output.request_id]
            handle._publish(output)

    def _fail_everything(self, failure: EngineFailed) -> None:
        """The engine can never step again: say so first (the worker stops taking work), then fail every request in
        flight or queued with `failure`; later submits and stats calls raise it."""
        with self._wakeup:
            self.failure = failure
            commands, self._commands = self._commands, []
        try:
            if self._on_failure is not None:
                self._on_failure(failure)
        finally:  # whatever the callback did, no caller may be left waiting
            for command in commands:
                if isinstance(command, _Submit):
                    command.handle._fail(failure)
                elif isinstance(command, _ReadStats):
                    command.answer.set_exception(failure)
            for handle in self._handles.values():
                handle._fail(failure)
            self._handles.clear()
