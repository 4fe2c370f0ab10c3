"""Images through the service: a worker whose model is a vision-language model (a tiny LLaVA-1.5 folder as
CONVEYOR_MODEL) answers a batch file mixing image and text lines through the openai SDK, `/v1/models` says it takes
images, and a corrupt image fails its own line only; a RAG job reads a PDF of its inbox as pages that model
transcribes (the job bound to it at creation, its chunks on its queue)."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest

from jobs.object_keys import inbox_key
from jobs.settings import Settings, replace
from jobs.storage import ObjectStore
from tests.api.test_rag_jobs import Tenant
from tests.api.test_batch_service import CHAT, client_for, jsonl, read_jsonl, wait_for
from tests.stack_fixtures import running_stack
from bench.vision_models import image
from tests.scanned_pages import page, pdf_of

pytestmark = pytest.mark.slow


def image_line(custom_id: str, png: bytes, text: str = "describe this picture") -> dict[str, Any]:
    url = "data:image/png;base64," + base64.b64encode(png).decode()
    content = [{"type": "text", "text": text}, {"type": "image_url", "image_url": {"url": url}}]
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 4, "temperature": 0, "logprobs": True}
    return {"custom_id": custom_id, "method": "POST", "url": CHAT, "body": body}


def test_a_vision_worker_answers_image_lines(private_stack_settings: Settings, llava_folder: Path, tmp_path: Path) -> None:
    out = io.BytesIO()
    image(1, 40, 33).save(out, format="PNG")
    png = out.getvalue()
    settings = replace(private_stack_settings, model=str(llava_folder), dtype="float32")
    with running_stack(settings, tmp_path / "stack") as stack:
        client = client_for(stack, stack.new_key("vision"))
        modalities = {model.id: model.model_extra["input_modalities"] for model in client.models.list()}
        assert sorted(modalities.values()) == [["text"], ["text", "image"]]  # the embedding model reads text
        text = {"messages": [{"role": "user", "content": "describe this picture"}], "max_tokens": 4, "temperature": 0}
        lines = [
            image_line("picture", png),
            {"custom_id": "text", "method": "POST", "url": CHAT, "body": text},
            image_line("corrupt", png[:60]),
        ]
        upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
        done = wait_for(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 2, done
        answers = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(client, done.output_file_id)}
        assert len(answers["picture"]["choices"][0]["logprobs"]["content"]) == 4
        # the picture's 16 placeholder tokens count in its usage
        assert answers["picture"]["usage"]["prompt_tokens"] == answers["text"]["usage"]["prompt_tokens"] + 16
        errors = read_jsonl(client, done.error_file_id)
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("corrupt", "image_unreadable")]

        # A RAG job reading PDFs as pages: the worker's LLaVA transcribes both pages; the passages are slices of the
        # transcription, which the manifest's transcriptions file holds.
        tenant = Tenant(stack, "vision-rag")
        ObjectStore(settings.s3).put_bytes(inbox_key(tenant.id, "scans/form.pdf"), pdf_of([page(1, 120, 160), page(2, 120, 160)]))
        options = {"pdf_mode": "pages", "page_dpi": 36, "page_max_tokens": 8, "chunk_tokens": 16, "overlap_tokens": 0}
        created = tenant.create_job(input_prefix="scans/", options=options)
        [vision_model] = [name for name, reads in modalities.items() if "image" in reads]
        assert created["model"] == vision_model  # bound at creation to the served model that reads images
        job = tenant.finished_job(created["id"])
        assert job["status"] == "completed" and job["request_counts"] == {"total": 1, "completed": 1, "failed": 0}, job
        manifest = tenant.manifest(job)
        assert (manifest["counts"]["pages_transcribed"], manifest["counts"]["pages_failed"]) == (2, 0)
        [entry] = [json.loads(row) for row in tenant.content(manifest["transcriptions_file_id"]).splitlines()]
        assert (entry["doc_id"], entry["pages"], entry["page_errors"]) == ("form.pdf", 2, [])
        assert entry["text"].startswith("<!-- page 1 -->\n") and "\n\n<!-- page 2 -->\n" in entry["text"]
        rows = tenant.table(job["output_file_id"]).to_pylist()
        assert rows and all(entry["text"][row["char_start"] : row["char_end"]] == row["text"] for row in rows)
