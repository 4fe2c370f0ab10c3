"""The service's records in PostgreSQL (SQLAlchemy 2.0). Payloads live in S3; these rows point at them.

Every object a client can see belongs to one project (tenant); queries always filter by it, so another
project's ids simply do not exist for a caller.
"""

from __future__ import annotations

import enum
import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import BigInteger, DateTime, Enum, ForeignKey, Index, Integer, String, func
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


def new_id(prefix: str) -> str:
    return prefix + secrets.token_hex(12)


class Base(DeclarativeBase):
    pass


class Project(Base):
    __tablename__ = "projects"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("proj_"))
    name: Mapped[str] = mapped_column(String(200), unique=True)
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("key_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"), index=True)
    key_hash: Mapped[str] = mapped_column(
        String(64), unique=True
    )  # sha256 hex of the secret; the secret itself is never stored
    key_hint: Mapped[str] = mapped_column(String(32))  # the first characters, to tell keys apart in listings
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), server_default=func.now())
    revoked_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class FilePurpose(str, enum.Enum):
    batch = "batch"  # a client's batch input
    batch_output = "batch_output"  # a batch's output or error file, written by finalize


class File(Base):
    __tablename__ = "files"
    __table_args__ = (Index("ix_files_project_created", "project_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("file-"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    filename: Mapped[str] = mapped_column(String(1024))
    purpose: Mapped[FilePurpose] = mapped_column(Enum(FilePurpose, name="file_purpose"))
    bytes: Mapped[int] = mapped_column(BigInteger)
    object_key: Mapped[str] = mapped_column(String(1024))  # relative to the configured S3 prefix
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)


class BatchStatus(str, enum.Enum):
    validating = "validating"
    failed = "failed"
    in_progress = "in_progress"
    finalizing = "finalizing"
    completed = "completed"
    expired = "expired"
    cancelling = "cancelling"
    cancelled = "cancelled"


TERMINAL_BATCH_STATUSES = frozenset(
    {BatchStatus.failed, BatchStatus.completed, BatchStatus.expired, BatchStatus.cancelled}
)


class Batch(Base):
    __tablename__ = "batches"
    __table_args__ = (Index("ix_batches_project_created", "project_id", "created_at", "id"),)

    id: Mapped[str] = mapped_column(String(64), primary_key=True, default=lambda: new_id("batch_"))
    project_id: Mapped[str] = mapped_column(ForeignKey("projects.id", ondelete="CASCADE"))
    # A plain id, not a foreign key: deleting the input file later must not erase the batch's history.
    input_file_id: Mapped[str] = mapped_column(String(64))
    endpoint: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(16))
    status: Mapped[BatchStatus] = mapped_column(Enum(BatchStatus, name="batch_status"), default=BatchStatus.validating)
    batch_metadata: Mapped[dict[str, str] | None] = mapped_column("metadata", JSONB)
    errors: Mapped[list[dict[str, Any]] | None] = mapped_column(JSONB)  # batch-level errors (OpenAI's errors.data)
    total_requests: Mapped[int] = mapped_column(Integer, default=0)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    output_file_id: Mapped[str | None] = mapped_column(String(64))
    error_file_id: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(DateTime(timezone=True))
    in_progress_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalizing_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    completed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    failed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    expired_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelling_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    cancelled_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))


class ChunkStatus(str, enum.Enum):
    pending = "pending"
    done = "done"  # its output objects exist and its counts are in the batch's
    skipped = "skipped"  # never ran: the batch was cancelled first


class Chunk(Base):
    """A byte range of a batch's input file: the unit of work one `run_chunk` task does."""

    __tablename__ = "chunks"

    batch_id: Mapped[str] = mapped_column(ForeignKey("batches.id", ondelete="CASCADE"), primary_key=True)
    index: Mapped[int] = mapped_column(Integer, primary_key=True)
    byte_start: Mapped[int] = mapped_column(BigInteger)
    byte_end: Mapped[int] = mapped_column(BigInteger)  # exclusive
    first_line: Mapped[int] = mapped_column(Integer)  # 1-based line number of the range's first line
    num_requests: Mapped[int] = mapped_column(Integer)  # valid requests in the range
    # Line numbers in the range that validation already rejected (their error records are written): skipped here.
    rejected_lines: Mapped[list[int]] = mapped_column(JSONB, default=list)
    status: Mapped[ChunkStatus] = mapped_column(Enum(ChunkStatus, name="chunk_status"), default=ChunkStatus.pending)
    completed_requests: Mapped[int] = mapped_column(Integer, default=0)
    failed_requests: Mapped[int] = mapped_column(Integer, default=0)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
