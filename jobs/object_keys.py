"""Where each payload lives in the bucket (relative to the configured prefix)."""

from __future__ import annotations


def file_key(project_id: str, file_id: str, extension: str = "jsonl") -> str:
    return f"files/{project_id}/{file_id}.{extension}"


def batch_prefix(batch_id: str) -> str:
    """Everything a batch's run writes before finalize composes its files: validation's errors, the chunks' parts."""
    return f"batches/{batch_id}/"


def validation_errors_key(batch_id: str) -> str:
    return f"{batch_prefix(batch_id)}validation_errors.jsonl"


def chunk_output_key(batch_id: str, index: int) -> str:
    """Written last by run_chunk: its existence means the chunk's results are complete."""
    return f"{batch_prefix(batch_id)}chunks/{index:06d}.output.jsonl"


def chunk_transcriptions_key(batch_id: str, index: int) -> str:
    """A RAG chunk's page transcriptions (`pdf_mode` "pages"), written before its output object names it."""
    return f"{batch_prefix(batch_id)}chunks/{index:06d}.transcriptions.jsonl"


def chunk_errors_key(batch_id: str, index: int) -> str:
    return f"{batch_prefix(batch_id)}chunks/{index:06d}.errors.jsonl"


def expired_requests_key(batch_id: str) -> str:
    """`batch_expired` error lines for the requests of an expired batch's chunks that never ran."""
    return f"{batch_prefix(batch_id)}expired_requests.jsonl"


def inbox_key(project_id: str, relative_key: str) -> str:
    """A key in the project's inbox, where the project's own tools drop inputs that schedules read by prefix.

    The trailing slash after the project id keeps one project's area from being a prefix of another's."""
    return f"inbox/{project_id}/{relative_key}"


def rag_cache_prefix(project_id: str) -> str:
    """Where a project's cached RAG chunks live (`jobs.rag.processing.ObjectStorePassageCache`), one object per
    document and settings. Per project: a cache hit would otherwise tell one tenant what another processed."""
    return f"rag-cache/{project_id}/"


# One newline byte, composed between inbox objects whose last line has no newline, so lines never merge.
NEWLINE_KEY = "shared/newline"
