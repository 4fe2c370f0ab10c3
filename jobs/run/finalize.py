"""Finalize's files: the done chunks' objects composed into a job's output and error files.

Outputs are composed in the store, not downloaded: `ObjectStore.compose` copies sources of at least 5 MiB
server-side (S3 multipart copy) and uploads runs of smaller ones as one part, so memory stays bounded. The error
file gathers validation's error records, the chunks' and, for an expired job, one `batch_expired` record per
request of the chunks that never started. File ids derive from the job's id (`jobs.files.derived_file_id`): a
second finalize overwrites, it does not add twins.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from jobs.files import derived_file_id
from jobs.models import Batch, BatchStatus, Chunk, File, FilePurpose
from jobs.object_keys import chunk_errors_key, chunk_output_key, expired_requests_key, file_key, validation_errors_key
from jobs.run.kinds import FinishedChunks, JobKind
from jobs.run.split import InputLines, RequestId
from jobs.stop_flags import StopReason
from jobs.storage import ObjectStore

ChunkRequestIds = Callable[[Batch, Chunk], list[RequestId]]


@dataclass(frozen=True)
class FinalFiles:
    files: list[File]  # rows to add with the final status
    output_file_id: str | None
    error_file_id: str | None
    expired_unstarted: int  # requests of chunks that never ran, failed by the expiry


def stop_reason_of(batch: Batch) -> StopReason | None:
    """Why a batch on its way to finalize is stopping early, if it is."""
    if batch.status == BatchStatus.cancelling:
        return StopReason.cancelled
    if batch.expired_at is not None:
        return StopReason.expired
    return None


def compose_file(store: ObjectStore, project_id: str, file_id: str, filename: str, sources: list[str]) -> File:
    """The sources that exist, in order, as one file."""
    existing = [key for key in sources if store.exists(key)]
    key = file_key(project_id, file_id)
    size = store.compose(key, existing)
    return File(
        id=file_id,
        project_id=project_id,
        filename=filename,
        purpose=FilePurpose.batch_output,
        bytes=size,
        object_key=key,
    )


def compose_final_files(
    store: ObjectStore,
    kind: JobKind,
    batch: Batch,
    done: list[int],
    failed: list[int],
    never_started: list[Chunk],
    stop_reason: StopReason | None,
    chunk_request_ids: ChunkRequestIds,
) -> FinalFiles:
    """The job's output, error and report files from its done chunks (`done`: their indexes, in order) and the
    error records of its failed ones (`failed`); for an expired job, `never_started` are its skipped chunks, whose
    requests get an expiry record each."""
    completed, failed_requests = batch.completed_requests, batch.failed_requests
    expired_unstarted = sum(chunk.num_requests for chunk in never_started)
    if expired_unstarted:
        _write_expired_requests(store, batch, never_started, kind.input_lines(batch), chunk_request_ids)
    failed_requests += expired_unstarted
    finished = FinishedChunks(batch, [chunk_output_key(batch.id, index) for index in done], stop_reason)
    files: list[File] = []
    output_file_id = error_file_id = None
    if completed:
        output_file_id = derived_file_id(batch.id, "output")
        files.append(kind.output_file(finished, output_file_id))
    if failed_requests:
        error_file_id = derived_file_id(batch.id, "error")
        with_errors = sorted(done + failed)
        sources = [validation_errors_key(batch.id)] + [chunk_errors_key(batch.id, index) for index in with_errors]
        sources.append(expired_requests_key(batch.id))
        files.append(compose_file(store, batch.project_id, error_file_id, f"{batch.id}_error.jsonl", sources))
    files += kind.report_files(finished, failed=failed_requests, output_file_id=output_file_id, error_file_id=error_file_id)
    return FinalFiles(files, output_file_id, error_file_id, expired_unstarted)


def _write_expired_requests(
    store: ObjectStore, batch: Batch, chunks: list[Chunk], lines: InputLines, chunk_request_ids: ChunkRequestIds
) -> None:
    """A `batch_expired` error line for each request of the chunks that never ran, as OpenAI reports them."""
    with store.upload_stream(expired_requests_key(batch.id)) as records:
        for chunk in chunks:
            for request_id in chunk_request_ids(batch, chunk):
                records.write(lines.expired_record(request_id))
