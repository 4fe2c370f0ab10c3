"""Where each payload lives in the bucket (relative to the configured prefix)."""

from __future__ import annotations


def file_key(project_id: str, file_id: str) -> str:
    return f"files/{project_id}/{file_id}.jsonl"


def validation_errors_key(batch_id: str) -> str:
    return f"batches/{batch_id}/validation_errors.jsonl"


def chunk_output_key(batch_id: str, index: int) -> str:
    """Written last by run_chunk: its existence means the chunk's results are complete."""
    return f"batches/{batch_id}/chunks/{index:06d}.output.jsonl"


def chunk_errors_key(batch_id: str, index: int) -> str:
    return f"batches/{batch_id}/chunks/{index:06d}.errors.jsonl"
