"""RAG preprocessing jobs through the whole service: /v1/rag/jobs on the shared stack's API and worker (SmolLM2 for
contexts, the embedding model loaded on the first chunk), PostgreSQL, Redis and SeaweedFS. The documents are real
files (a PDF, an HTML page, Markdown) in a project's inbox, and JSONL lines with inline texts and S3 URIs."""

from __future__ import annotations

import io
import json
import time
from typing import Any

import httpx
import numpy as np
import openai
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.keys import create_key_in_database
from jobs.object_keys import inbox_key
from jobs.rag.documents import extract_text
from jobs.storage import ObjectStore
from tests.api.test_batch_service import jsonl
from tests.jobs.test_rag_documents import pdf_with_pages
from tests.stack_fixtures import Stack

pytestmark = pytest.mark.slow

PARQUET_COLUMNS = ["doc_id", "chunk_index", "text", "context", "token_count", "char_start", "char_end", "metadata",
                   "embedding"]
OPTIONS = {"chunk_tokens": 48, "overlap_tokens": 8}  # small chunks: every document makes several

REPORT_PDF = pdf_with_pages(
    [
        ["Annual report of the harbour authority.", "Cargo volumes rose by nine percent this year.",
         "Container traffic reached a record high in the autumn."],
        ["Outlook for the coming year.", "The new quay opens in spring, e.g. for larger ships.",
         "Dredging of the channel continues until the summer."],
    ]
)
ARTICLE_HTML = b"""<!doctype html><html><head><title>Glaciers</title></head><body>
<nav><a href="/">Home</a> | <a href="/about">About</a></nav>
<article>
<h1>How glaciers move</h1>
<p>Glaciers flow under their own weight. Ice deep inside a glacier deforms slowly, like a very thick fluid,
and the whole mass creeps downhill at a few centimetres to several metres per day.</p>
<h2>Basal sliding</h2>
<p>Where meltwater reaches the bed, it lubricates the contact between ice and rock. The glacier then slides
over its bed, which can make it surge forward much faster than deformation alone would allow.</p>
<h2>Crevasses</h2>
<p>Where the ice speeds up or bends over a step in the bedrock, its brittle surface cracks open into crevasses,
which can be tens of metres deep and are hidden under snow bridges in winter.</p>
</article>
<footer>Copyright the glacier society</footer>
</body></html>"""
NOTES_MD = """# Field notes

## Monday

We walked along the ridge to the old weather station. The wind was strong from the west and the clouds stayed
low all morning. In the afternoon the sky cleared and we could see the whole valley below.

## Tuesday

Rain all day. We stayed in the hut, repaired the radio and sorted the samples collected on Monday. Dr. Berg
labelled every bag with the time and place it was filled.

## Wednesday

The river had risen overnight. We measured its flow at three points and found it twice as fast as last week.
""".encode()


class Tenant:
    def __init__(self, stack: Stack, name: str) -> None:
        created = create_key_in_database(stack.settings.database_url, name)
        self.id = created.project_id
        headers = {"Authorization": f"Bearer {created.secret}"}
        self.http = httpx.Client(base_url=stack.base_url, headers=headers, timeout=30)
        self.sdk = openai.OpenAI(api_key=created.secret, base_url=stack.base_url, max_retries=0, timeout=30)

    def create_job(self, **body: Any) -> dict[str, Any]:
        response = self.http.post("/rag/jobs", json=body)
        assert response.status_code == 200, response.text
        job: dict[str, Any] = response.json()
        return job

    def finished_job(self, job_id: str, timeout_s: float = 300.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            job: dict[str, Any] = self.http.get(f"/rag/jobs/{job_id}").json()
            if job["status"] in ("completed", "failed", "cancelled", "expired"):
                return job
            assert time.monotonic() < deadline, f"job {job_id} still {job['status']} after {timeout_s} s"
            time.sleep(0.5)

    def content(self, file_id: str) -> bytes:
        response = self.http.get(f"/files/{file_id}/content")
        assert response.status_code == 200, response.text
        return response.content

    def table(self, file_id: str) -> pa.Table:
        return pq.read_table(io.BytesIO(self.content(file_id)))

    def manifest(self, job: dict[str, Any]) -> dict[str, Any]:
        manifest: dict[str, Any] = json.loads(self.content(job["manifest_file_id"]))
        return manifest

    def errors(self, job: dict[str, Any]) -> dict[str | None, str]:
        lines = self.content(job["error_file_id"]).decode().splitlines()
        return {record["doc_id"]: record["error"]["code"] for record in map(json.loads, lines)}


def rows_by_document(table: pa.Table) -> dict[str, list[dict[str, Any]]]:
    documents: dict[str, list[dict[str, Any]]] = {}
    for row in table.to_pylist():
        documents.setdefault(row["doc_id"], []).append(row)
    return documents


def assert_chunks_are_slices_of(rows: list[dict[str, Any]], source: str) -> None:
    assert [row["chunk_index"] for row in rows] == list(range(len(rows)))
    assert len(rows) >= 2  # 48-token chunks: every test document needs several
    for row in rows:
        assert source[row["char_start"] : row["char_end"]] == row["text"] and row["text"].strip()
        assert 0 < row["token_count"] <= OPTIONS["chunk_tokens"]
        assert len(row["embedding"]) == 384
    assert rows[0]["char_start"] == len(source) - len(source.lstrip())  # nothing lost at the start...
    assert rows[-1]["char_end"] == len(source.rstrip())  # ...or at the end


def test_rag_jobs_turn_inbox_files_and_document_lines_into_parquet_chunks(
    stack: Stack, object_store: ObjectStore
) -> None:
    tenant, neighbour = Tenant(stack, "rag-tenant"), Tenant(stack, "rag-neighbour")
    inbox_files = {"report.pdf": REPORT_PDF, "page.html": ARTICLE_HTML, "notes.md": NOTES_MD,
                   "broken.pdf": b"%PDF-1.4\nthis is no PDF at all\n%%EOF\n"}
    for name, data in inbox_files.items():
        object_store.put_bytes(inbox_key(tenant.id, f"docs/{name}"), data)
    object_store.put_bytes(inbox_key(neighbour.id, "docs/secret.md"), b"# The neighbour's secret\n\nNot yours.\n")
    sources = {name: extract_text(name, data) for name, data in inbox_files.items() if name != "broken.pdf"}

    # --- every object under an inbox prefix, one of them a corrupt PDF
    job = tenant.create_job(input_prefix="docs/", options=OPTIONS, metadata={"run": "first"})
    assert job["object"] == "rag.job" and job["status"] == "validating" and job["input_prefix"] == "docs/"
    assert job["options"]["chunk_tokens"] == 48 and job["options"]["embedding_model"] == stack.settings.embedding_model
    done = tenant.finished_job(job["id"])
    assert done["status"] == "completed", done
    assert done["request_counts"] == {"total": 4, "completed": 3, "failed": 1}
    assert tenant.errors(done) == {"broken.pdf": "unreadable_document"}

    table = tenant.table(done["output_file_id"])
    assert table.column_names == PARQUET_COLUMNS
    assert table.schema.field("embedding").type == pa.list_(pa.float32())
    first_rows = rows_by_document(table)
    assert set(first_rows) == set(sources)
    for name, rows in first_rows.items():
        assert_chunks_are_slices_of(rows, sources[name])
        assert all(row["context"] is None for row in rows)
    vectors = np.array(table.column("embedding").to_pylist(), dtype=np.float32)
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-3)  # the model's normalized embeddings
    assert tenant.http.get(f"/files/{done['output_file_id']}").json()["filename"] == f"{job['id']}.parquet"

    manifest = tenant.manifest(done)
    assert manifest["job_id"] == job["id"] and manifest["status"] == "completed"
    assert manifest["counts"] == {
        "documents": 4, "documents_completed": 3, "documents_failed": 1, "documents_from_cache": 0,
        "chunks": table.num_rows, "chunks_embedded": table.num_rows, "contexts_generated": 0,
        "pages_transcribed": 0, "pages_failed": 0, "pages_from_cache": 0,
    }
    assert manifest["embedding_model"] == stack.settings.embedding_model and manifest["generation_model"] is None
    assert (manifest["output_file_id"], manifest["error_file_id"]) == (done["output_file_id"], done["error_file_id"])

    # --- the same input with the same options again: every document comes from the cache, nothing is embedded
    rerun = tenant.finished_job(tenant.create_job(input_prefix="docs/", options=OPTIONS)["id"])
    assert rerun["status"] == "completed" and rerun["request_counts"] == done["request_counts"]
    rerun_counts = tenant.manifest(rerun)["counts"]
    assert (rerun_counts["chunks_embedded"], rerun_counts["documents_from_cache"]) == (0, 3)
    assert tenant.table(rerun["output_file_id"]).equals(table)

    # --- JSONL document lines: inline texts, URIs inside the inbox and outside it, a missing object, a bad line
    bucket_root = f"s3://{stack.settings.s3.bucket}/{stack.settings.s3.prefix}"
    inline = "Tea was first drunk in China. It reached Europe in the seventeenth century. " * 6
    lines: list[dict[str, Any] | str] = [
        {"id": "inline-tea", "text": inline, "metadata": {"source": "wiki", "year": 2024}},
        {"id": "notes-again", "uri": f"{bucket_root}{inbox_key(tenant.id, 'docs/notes.md')}"},
        {"id": "neighbours", "uri": f"{bucket_root}{inbox_key(neighbour.id, 'docs/secret.md')}"},
        {"id": "outside", "uri": f"{bucket_root}files/{tenant.id}/anything.jsonl"},
        {"id": "climbing-out", "uri": f"{bucket_root}{inbox_key(tenant.id, '../' + neighbour.id + '/docs/secret.md')}"},
        {"id": "missing", "uri": f"{bucket_root}{inbox_key(tenant.id, 'docs/nothing-here.md')}"},
        "{not json",
        {"id": "inline-tea", "text": "a second document with the same id"},
        {"id": "short", "text": "One short sentence."},
    ]
    upload = tenant.sdk.files.create(file=("documents.jsonl", jsonl(lines)), purpose="batch")
    lines_job = tenant.finished_job(tenant.create_job(input_file_id=upload.id, options=OPTIONS)["id"])
    assert lines_job["status"] == "completed", lines_job
    assert lines_job["request_counts"] == {"total": 9, "completed": 3, "failed": 6}
    assert tenant.errors(lines_job) == {
        "neighbours": "uri_outside_inbox", "outside": "uri_outside_inbox", "climbing-out": "uri_outside_inbox",
        "missing": "document_not_found", None: "invalid_json_line", "inline-tea": "duplicate_document_id",
    }
    rows = rows_by_document(tenant.table(lines_job["output_file_id"]))
    assert set(rows) == {"inline-tea", "notes-again", "short"}
    assert_chunks_are_slices_of(rows["inline-tea"], inline)
    assert {json.loads(row["metadata"])["source"] for row in rows["inline-tea"]} == {"wiki"}
    assert [row["text"] for row in rows["notes-again"]] == [row["text"] for row in first_rows["notes.md"]]
    assert [row["text"] for row in rows["short"]] == ["One short sentence."]
    lines_counts = tenant.manifest(lines_job)["counts"]
    assert lines_counts["documents_from_cache"] == 1  # notes.md, cached by the first job of this project
    assert lines_counts["chunks_embedded"] == len(rows["inline-tea"]) + 1

    # --- rag jobs are no batches, and another project sees none of this
    assert job["id"] not in {batch.id for batch in tenant.sdk.batches.list()}
    with pytest.raises(openai.NotFoundError):
        tenant.sdk.batches.retrieve(job["id"])
    listed = tenant.http.get("/rag/jobs", params={"limit": 2}).json()
    assert [item["id"] for item in listed["data"]] == [lines_job["id"], rerun["id"]] and listed["has_more"]
    assert neighbour.http.get(f"/rag/jobs/{job['id']}").status_code == 404
    assert neighbour.http.post(f"/rag/jobs/{job['id']}/cancel").status_code == 404
    assert neighbour.http.get(f"/files/{done['output_file_id']}/content").status_code == 404
    assert neighbour.http.get("/rag/jobs").json()["data"] == []
    assert neighbour.http.post("/rag/jobs", json={"input_file_id": upload.id}).status_code == 404


def test_rag_job_requests_are_checked_and_a_job_can_be_cancelled(stack: Stack) -> None:
    tenant = Tenant(stack, "rag-checks")
    documents: list[dict[str, Any] | str] = [{"id": f"doc-{i}", "text": f"Text number {i}."} for i in range(40)]
    upload = tenant.sdk.files.create(file=("docs.jsonl", jsonl(documents)), purpose="batch")
    refused = [
        ({"input_file_id": upload.id, "input_prefix": "docs/"}, "input_file_id"),
        ({}, "input_file_id"),
        ({"input_prefix": "../elsewhere/"}, "input_prefix"),
        ({"input_prefix": "empty/"}, "input_prefix"),
        ({"input_file_id": upload.id, "options": {"chunk_tokens": 32, "overlap_tokens": 32}}, "options"),
        ({"input_file_id": upload.id, "options": {"context_prompt": "no placeholders"}}, "options"),
        ({"input_file_id": upload.id, "options": {"pdf_mode": "pages", "page_dpi": 10}}, "options"),
        ({"input_file_id": upload.id, "options": {"embedding_model": "another-model"}}, "options.embedding_model"),
        ({"input_file_id": upload.id, "completion_window": "1h"}, "completion_window"),
    ]
    for body, param in refused:
        response = tenant.http.post("/rag/jobs", json=body)
        assert (response.status_code, response.json()["error"]["param"]) == (400, param), (body, response.text)
    # The shared worker's SmolLM2 reads no images: a job reading PDFs as pages is refused now, not failed page by page
    response = tenant.http.post("/rag/jobs", json={"input_file_id": upload.id, "options": {"pdf_mode": "pages"}})
    error = response.json()["error"]
    assert (response.status_code, error["code"], error["param"]) == (400, "model_not_multimodal", "options.pdf_mode")
    assert "read text only (" in error["message"] and "'smollm2-135m-instruct'" in error["message"]

    job = tenant.create_job(input_file_id=upload.id)
    assert job["model"] is None  # reading text: any worker's
    cancelling = tenant.http.post(f"/rag/jobs/{job['id']}/cancel").json()
    assert cancelling["status"] in ("cancelling", "cancelled")
    cancelled = tenant.finished_job(job["id"])
    assert cancelled["status"] == "cancelled" and cancelled["manifest_file_id"] is not None
    assert tenant.manifest(cancelled)["status"] == "cancelled"


def test_a_contextualized_job_stores_each_chunks_generated_context(stack: Stack) -> None:
    tenant = Tenant(stack, "rag-contexts")
    text = "The Rhine rises in the Swiss Alps. It flows north through Germany and reaches the sea in the Netherlands."
    upload = tenant.sdk.files.create(file=("one.jsonl", jsonl([{"id": "rhine", "text": text}])), purpose="batch")
    job = tenant.create_job(input_file_id=upload.id, options={"contextualize": True, "context_max_tokens": 16})
    done = tenant.finished_job(job["id"])
    assert done["status"] == "completed", done
    rows = tenant.table(done["output_file_id"]).to_pylist()
    assert [row["text"] for row in rows] == [text]
    assert rows[0]["context"].strip()
    manifest = tenant.manifest(done)
    assert manifest["counts"]["contexts_generated"] == 1 and manifest["generation_model"]
