"""Two models, two workers: each batch is answered by the model its lines name, /v1/models lists both."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import transformers
from openai.types.responses import Response

from conveyor.local_stack import start_worker
from jobs.settings import Settings, replace
from tests.api.test_batch_service import chat_line, client_for, jsonl, read_jsonl, wait_for
from tests.stack_fixtures import running_stack

pytestmark = pytest.mark.slow


def tiny_model_with_smollm2_tokenizer(smollm2_folder: Path, folder: Path) -> Path:
    """A random two-layer Llama saved by transformers, with SmolLM2's tokenizer (and so its vocabulary size)."""
    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).float().save_pretrained(folder, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_folder / name, folder / name)
    return folder


def test_each_batch_is_answered_by_the_model_its_lines_name(
    private_stack_settings: Settings, smollm2_folder: Path, tmp_path: Path
) -> None:
    settings = replace(private_stack_settings, model_aliases="gpt-4o-mini=smollm2-135m-instruct")
    tiny = tiny_model_with_smollm2_tokenizer(smollm2_folder, tmp_path / "tiny-model")
    tiny_settings = replace(settings, model=str(tiny), served_model_names="tiny-llama,tiny")
    with running_stack(settings, tmp_path / "stack") as stack:
        second = start_worker(tiny_settings, tmp_path / "tiny-worker.log")
        try:
            client = client_for(stack, stack.new_key("two-models"))
            listed = {model.id: model for model in client.models.list()}
            assert {"smollm2-135m-instruct", "gpt-4o-mini", "tiny-llama", "tiny", "all-minilm-l6-v2"} <= set(listed)
            assert listed["tiny"].object == "model" and listed["tiny"].owned_by == "conveyor"
            assert client.models.retrieve("gpt-4o-mini").id == "gpt-4o-mini"

            answers: dict[str, dict[str, dict]] = {}
            for model in ("gpt-4o-mini", "tiny"):
                lines = [chat_line(f"{model}-{i}", f"Question {i}?", model=model) for i in range(3)]
                lines.append(chat_line(f"{model}-other", "Hi", model="llama-3-70b-instruct"))
                upload = client.files.create(
                    file=("in.jsonl", jsonl(lines)),
                    purpose="batch",
                    expires_after={"anchor": "created_at", "seconds": 7200},
                )
                assert upload.expires_at == upload.created_at + 7200
                batch = client.batches.create(
                    input_file_id=upload.id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                    output_expires_after={"anchor": "created_at", "seconds": 3600},
                )
                done = wait_for(client, batch.id)
                assert done.status == "completed" and done.request_counts.completed == 3, done
                answers[model] = {line["custom_id"]: line for line in read_jsonl(client, done.output_file_id)}
                for file_id in (done.output_file_id, done.error_file_id):
                    produced = client.files.retrieve(file_id)
                    assert produced.expires_at is not None and produced.expires_at - produced.created_at in (3600, 3601)
                errors = read_jsonl(client, done.error_file_id)
                assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [(f"{model}-other", "model_not_found")]
                assert done.model == ("smollm2-135m-instruct" if model == "gpt-4o-mini" else "tiny-llama")
                # The batch's usage is its answered lines' usage, summed.
                usages = [line["response"]["body"]["usage"] for line in answers[model].values()]
                assert done.usage is not None
                assert done.usage.input_tokens == sum(usage["prompt_tokens"] for usage in usages)
                assert done.usage.output_tokens == sum(usage["completion_tokens"] for usage in usages)
                assert done.usage.total_tokens == sum(usage["total_tokens"] for usage in usages)
                assert done.usage.input_tokens_details.cached_tokens == sum(
                    usage["prompt_tokens_details"]["cached_tokens"] for usage in usages
                )

            bodies = {m: [line["response"]["body"] for line in answers[m].values()] for m in answers}
            assert {body["model"] for body in bodies["gpt-4o-mini"]} == {"smollm2-135m-instruct"}
            assert {body["model"] for body in bodies["tiny"]} == {"tiny-llama"}
            # The random model's answers are not SmolLM2's: each batch ran on its own model's worker.
            assert [b["choices"][0]["message"]["content"] for b in bodies["gpt-4o-mini"]] != [
                b["choices"][0]["message"]["content"] for b in bodies["tiny"]
            ]
            assert b"run_chunk" in (tmp_path / "tiny-worker.log").read_bytes()

            # /v1/responses lines through the service: the SDK's own Response type parses every answer.
            responses = [
                {"custom_id": f"resp-{i}", "method": "POST", "url": "/v1/responses",
                 "body": {"model": "gpt-4o-mini", "input": f"Question {i}?", "max_output_tokens": 6, "temperature": 0}}
                for i in range(2)
            ]
            upload = client.files.create(file=("responses.jsonl", jsonl(responses)), purpose="batch")
            batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/responses", completion_window="24h")
            done = wait_for(client, batch.id)
            assert done.status == "completed" and done.request_counts.completed == 2, done
            for line in read_jsonl(client, done.output_file_id):
                parsed = Response.model_validate(line["response"]["body"])
                assert parsed.model == "smollm2-135m-instruct" and parsed.usage is not None and parsed.output_text
        finally:
            second.stop()
