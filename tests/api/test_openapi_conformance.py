"""Schemathesis over the API's own OpenAPI document, against a real API process (PostgreSQL, Redis, SeaweedFS):
generated valid and invalid requests to every operation, with every check schemathesis has (no server error,
documented status codes, content types, headers and response schemas, invalid data rejected, valid data accepted,
auth not ignored, 405 with Allow). A small example count per operation and mode keeps it a suite test; raise it
with CONVEYOR_SCHEMATHESIS_EXAMPLES for a longer hunt.

Two rules the document cannot state are left out of generation, and tested on their own in test_hostile_input:
NUL bytes (PostgreSQL stores no NUL in text: refused with 400), and the meaning of some fields (a cron expression,
an IANA time zone, a public webhook URL, a RAG job's input_file_id *or* input_prefix, a Message Batch's custom_ids
and whether it has ended), whose operations may refuse schema-valid data with 400.

Operations are driven one by one through schemathesis's own strategies (schemathesis's pytest plugin does not
load under pytest 9)."""

from __future__ import annotations

import os
import uuid

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.generation import GenerationMode

from tests.stack_fixtures import Stack

EXAMPLES = int(os.environ.get("CONVEYOR_SCHEMATHESIS_EXAMPLES", "8"))
ACCEPTED = ["2xx", "401", "404", "409"]  # a valid request names an object that may not exist, or may conflict
CONFIG = {
    "generation": {"allow-x00": False},
    "checks": {"positive_data_acceptance": {"expected-statuses": ACCEPTED}},
    "operations": [
        {
            "include-path-regex": "^/v1/(schedules|webhooks|webhook_endpoints|rag/jobs|messages/batches)",
            "checks": {"positive_data_acceptance": {"expected-statuses": [*ACCEPTED, "400"]}},
        }
    ],
}


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE], ids=lambda mode: mode.value)
def test_the_api_answers_as_its_openapi_document_says(api_only_stack: Stack, mode: GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(
        api_only_stack.base_url.removesuffix("/v1") + "/openapi.json", config=schemathesis.Config.from_dict(CONFIG)
    )
    auth = {"Authorization": f"Bearer {api_only_stack.new_key(f'schemathesis-{uuid.uuid4().hex[:8]}')}"}
    failures: list[str] = []
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) > 20, "every route is in the document"
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def conforms(case: schemathesis.Case) -> None:
            case.call_and_validate(headers=auth)

        try:
            conforms()
        except Unsatisfiable:  # an operation without parameters or body has no invalid input to send
            assert mode is GenerationMode.NEGATIVE, f"{operation.method.upper()} {operation.path}"
        except Exception as failure:  # every operation is tried; the failures are reported together
            failures.append(f"{operation.method.upper()} {operation.path}: {failure}")
    assert not failures, "\n\n".join(failures)
