"""The worker process of test_worker_engine_failure.py: the real Celery worker (`jobs.worker.consume`, `jobs.tasks`)
over a real engine sharded over two CPU processes, whose rank 1 is killed while a chunk's request runs.

    python -m tests.jobs.engine_failure_worker MODEL_FOLDER QUEUE    (Redis prefix from CONVEYOR_REDIS_PREFIX)
"""

from __future__ import annotations

import sys
import time

from engine.engine_loop import EngineLoop
from engine.sampling_params import SamplingParams
from jobs.settings import Settings

RUNNING = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)


class RankKillingPipeline:
    """Stands in for `jobs.run.pipeline.Pipeline` (no database or S3): its run_chunk starts a request on the engine,
    as a chunk's lines are, kills rank 1 once the request is running, and waits for the request."""

    def __init__(self, settings: Settings, loop: EngineLoop) -> None:
        self.settings = settings
        self.loop = loop

    def run_chunk(self, batch_id: str, index: int) -> None:
        handle = self.loop.submit([1, 2, 3], RUNNING)
        while not handle.done() and self.loop.stats().num_running == 0:  # until it is in the running batch
            time.sleep(0.01)
        (rank1,) = self.loop.engine.runner.ranks.processes
        if rank1.is_alive():  # the chunk may come back to this worker before it stops
            rank1.kill()
        handle.result()


def main(model: str, queue: str) -> int:
    # Imported here, not above: the engine's rank process imports this module again, and needs none of them.
    from engine.llm_engine import LLMEngine
    from jobs.celery_app import celery_app
    from jobs.tasks import register_tasks
    from jobs.worker import consume, stop_this_worker

    settings = Settings.from_env()
    loop = EngineLoop.build(
        lambda: LLMEngine(model, dtype="float32", device="cpu", tensor_parallel_size=2), on_failure=stop_this_worker
    )
    register_tasks(celery_app, RankKillingPipeline(settings, loop))  # type: ignore[arg-type]
    return consume(loop, settings, [queue], "INFO", None)


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
