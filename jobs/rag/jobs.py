"""RAG preprocessing jobs as a client sees them: create, read, list, cancel. The work is `jobs.rag.kind`'s.

A RAG job is a batch row with endpoint `RAG_ENDPOINT` and its options in `rag_options`, so projects, statuses,
cancel, expiry, webhooks (`batch.*` events) and request counts (here counting documents) work as for batches.

Its input is a JSONL file of document lines (`{"id", "text" | "uri", "metadata"}`) or every object under a prefix
of the project's inbox. A prefix is listed once, when the job is created, into a JSONL input file of `{"id": key
relative to the prefix, "uri": "s3://..."}` lines: from then on both kinds are the same job, and the documents are
the objects that were there at creation, whatever lands under the prefix later.

A job that reads PDFs as pages (`pdf_mode` "pages") is bound at creation to a served model that reads images
(`job_model`): its `model`, whose workers alone validate it and take its chunks (the queue `gpu.<model id>`, as a
batch's). A deployment serving none refuses the job then (`model_not_multimodal`), instead of accepting it and failing
its pages. Other jobs are bound to no model: any worker takes their chunks.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from jobs.batches import (
    RAG_ENDPOINT,
    add_batch,
    check_completion_window,
    check_input_file,
    check_metadata,
    check_one_input,
    check_priority,
)
from jobs.errors import ServiceError
from jobs.files import derived_file_id, record_file
from jobs.models import TERMINAL_BATCH_STATUSES, Batch, BatchStatus, FilePurpose, new_id
from jobs.object_keys import file_key, inbox_key
from jobs.rag.processing import RagOptions
from jobs.served_models import ServedModel, image_models
from jobs.settings import S3Settings
from jobs.storage import ObjectStore

RAG_JOB_ID_PREFIX = "ragjob_"


@dataclass(frozen=True)
class RagJobSpec:
    """What a client asks for."""

    input_file_id: str | None
    input_prefix: str | None
    options: dict[str, Any]  # RagOptions fields the client set; the others take their defaults
    metadata: dict[str, str] | None
    completion_window: str
    priority: int


@dataclass(frozen=True)
class PrefixListing:
    """An inbox prefix's objects, written as the job's input file (not yet recorded in the database)."""

    file_id: str
    object_key: str
    size: int
    documents: int


@dataclass(frozen=True)
class PreparedRagJob:
    """A checked job, its id and, for an input prefix, its listing: all that comes before its rows."""

    job_id: str
    options: RagOptions
    listing: PrefixListing | None
    model: str | None  # the served model the job is bound to (`job_model`)


def new_job_id() -> str:
    return new_id(RAG_JOB_ID_PREFIX)


def manifest_file_id(job_id: str) -> str:
    """The id finalize gives the job's manifest (derived, like its output's, so a second finalize adds no twin)."""
    return derived_file_id(job_id, "manifest")


def has_manifest(job: Batch) -> bool:
    """Finalize writes a manifest for every job it ends; a failed job never got that far."""
    return job.status in TERMINAL_BATCH_STATUSES and job.status != BatchStatus.failed


def check_rag_job(spec: RagJobSpec, service_embedding_model: str) -> RagOptions:
    """Everything about the job but its input file; returns its options."""
    check_completion_window(spec.completion_window)
    check_metadata(spec.metadata)
    check_priority(spec.priority)
    check_one_input(spec.input_file_id, spec.input_prefix)
    try:
        options = RagOptions.from_json({"embedding_model": service_embedding_model, **spec.options})
    except (TypeError, ValueError) as invalid:
        raise ServiceError("invalid_request", f"options: {invalid}", param="options") from None
    if options.embedding_model != service_embedding_model:
        # Workers hold one embedding model (CONVEYOR_EMBEDDING_MODEL); another would need a model of its own.
        raise ServiceError(
            "invalid_request",
            f"options.embedding_model must be this service's embedding model, {service_embedding_model!r}; "
            f"got {options.embedding_model!r}",
            param="options.embedding_model",
        )
    return options


def job_model(options: RagOptions, served_models: Callable[[], list[ServedModel]]) -> str | None:
    """The served model a job must run on, from the deployment's models (`ModelRegistry.served`, read only for a job
    that needs one: creating the others does not wait on Redis); None when any worker's will do. Pages need a model
    that reads images: the first such by id when several are served, so that every job of a deployment reads its
    pages with the same model (and its transcription cache is shared)."""
    if options.pdf_mode != "pages":
        return None
    served = served_models()
    readers = image_models(served)
    if readers:
        return readers[0]
    text_only = sorted(model.id for model in served if model.kind == "generation" and model.parent is None)
    serving = (
        f"this deployment's models read text only ({', '.join(map(repr, text_only))})" if text_only
        else "no worker has announced a model (none is running)"  # as for a batch, no wait for one to start
    )
    raise ServiceError(
        "invalid_request",
        f"options.pdf_mode 'pages' needs a served model that reads images to transcribe the pages, and {serving}: "
        f"use pdf_mode 'text', or serve a vision-language model",
        param="options.pdf_mode", code="model_not_multimodal",
    )


def list_prefix(store: ObjectStore, s3: S3Settings, project_id: str, job_id: str, input_prefix: str) -> PrefixListing:
    """Write the objects under the project's inbox prefix, in key order, as the job's input lines."""
    prefix_key = inbox_key(project_id, input_prefix)
    objects = [found for found in store.list_objects(prefix_key) if not found.key.endswith("/")]  # "/": folder markers
    if not objects:
        raise ServiceError(
            "invalid_request", f"no objects under the inbox prefix {input_prefix!r}", param="input_prefix"
        )
    lines = [
        json.dumps({"id": found.key[len(prefix_key) :], "uri": f"s3://{s3.bucket}/{s3.prefix}{found.key}"}) + "\n"
        for found in objects
    ]
    data = "".join(lines).encode()
    file_id = derived_file_id(job_id, "documents")
    object_key = file_key(project_id, file_id)
    store.put_bytes(object_key, data)
    return PrefixListing(file_id=file_id, object_key=object_key, size=len(data), documents=len(objects))


def prepare_rag_job(
    store: ObjectStore,
    s3: S3Settings,
    project_id: str,
    spec: RagJobSpec,
    service_embedding_model: str,
    served_models: Callable[[], list[ServedModel]],
) -> PreparedRagJob:
    """Everything before the job's rows: its checks, its model (`served_models`: the deployment's, `job_model`), its
    id and, for an input prefix, the listing written to S3."""
    options = check_rag_job(spec, service_embedding_model)
    model = job_model(options, served_models)
    job_id = new_job_id()
    listing = None if spec.input_prefix is None else list_prefix(store, s3, project_id, job_id, spec.input_prefix)
    return PreparedRagJob(job_id=job_id, options=options, listing=listing, model=model)


def add_rag_job(
    session: Session, project_id: str, spec: RagJobSpec, prepared: PreparedRagJob, window_seconds: float | None
) -> Batch:
    """The job's row (and its listing's file row), `validating`."""
    job_id, listing = prepared.job_id, prepared.listing
    if listing is not None:
        record_file(
            session,
            file_id=listing.file_id,
            project_id=project_id,
            filename=f"{job_id}_documents.jsonl",
            purpose=FilePurpose.batch,
            size=listing.size,
            object_key=listing.object_key,
        )
        input_file_id = listing.file_id
    else:
        assert spec.input_file_id is not None  # check_rag_job: exactly one input
        check_input_file(session, project_id, spec.input_file_id)
        input_file_id = spec.input_file_id
    return add_batch(
        session,
        Batch(
            id=job_id,
            project_id=project_id,
            input_file_id=input_file_id,
            input_prefix=spec.input_prefix,
            endpoint=RAG_ENDPOINT,
            model=prepared.model,
            rag_options=prepared.options.to_json(),
            completion_window=spec.completion_window,
            priority=spec.priority,
            batch_metadata=spec.metadata,
        ),
        window_seconds,
    )
