"""Structured output through the whole service, driven by the `openai` SDK: a batch of extraction lines sharing
one JSON schema completes with every output valid, and bad schemas fail their own lines."""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.api.test_batch_service import CHAT, client_for, jsonl, read_jsonl, wait_for
from tests.stack_fixtures import Stack

pytestmark = pytest.mark.slow

INVOICE = {
    "type": "object",
    "properties": {
        "customer": {"type": "string", "maxLength": 40},
        "amount": {"type": "number", "minimum": 0},
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
        "paid": {"type": "boolean"},
    },
    "required": ["customer", "amount", "currency", "paid"],
    "additionalProperties": False,
}
DOCUMENTS = [
    "Invoice for Acme Ltd: 1200 EUR, settled on March 3.",
    "Bob's Bakery owes 35.50 USD, not yet paid.",
    "Globex Corporation was billed 980 GBP; payment received.",
    "Initech: 15000 USD outstanding.",
]


def extraction_line(custom_id: str, document: str, schema: object = INVOICE) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT,
        "body": {
            "messages": [
                {"role": "system", "content": "Extract the invoice fields as JSON."},
                {"role": "user", "content": document},
            ],
            "response_format": {"type": "json_schema", "json_schema": {"name": "invoice", "schema": schema, "strict": True}},
            "max_tokens": 80,
            "temperature": 0,
        },
    }


def test_an_extraction_batch_completes_with_every_output_valid(stack: Stack) -> None:
    client = client_for(stack, stack.new_key("structured-project"))
    good = [extraction_line(f"doc-{i}", DOCUMENTS[i % len(DOCUMENTS)]) for i in range(24)]
    bad = [
        extraction_line("bad-schema", DOCUMENTS[0], {"type": "objekt"}),
        extraction_line("unsupported", DOCUMENTS[0], {"type": "array", "uniqueItems": True}),
    ]
    upload = client.files.create(file=("extract.jsonl", jsonl([*good[:10], *bad, *good[10:]])), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint=CHAT, completion_window="24h")
    done = wait_for(client, batch.id, timeout_s=600)
    assert done.status == "completed", done
    outputs = read_jsonl(client, done.output_file_id)
    assert sorted(line["custom_id"] for line in outputs) == sorted(line["custom_id"] for line in good)
    for line in outputs:
        choice = line["response"]["body"]["choices"][0]
        assert choice["finish_reason"] == "stop", choice
        jsonschema.validate(json.loads(choice["message"]["content"]), INVOICE)
    errors = {line["custom_id"]: line["error"]["code"] for line in read_jsonl(client, done.error_file_id)}
    assert errors == {"bad-schema": "invalid_json_schema", "unsupported": "unsupported_json_schema"}
