"""LoRA adapters through the service: a worker serving two adapters on its model (CONVEYOR_LORA_ADAPTERS: one from the
object store, one local), one batch file mixing base and adapter lines through the openai SDK, /v1/models listing the
adapters with their parent."""

from __future__ import annotations

from pathlib import Path

import pytest

from jobs.settings import Settings, replace
from jobs.storage import ObjectStore
from tests.api.test_batch_service import chat_line, client_for, jsonl, read_jsonl, wait_for
from tests.stack_fixtures import running_stack
from tests.lora_adapters import save_smollm2_adapters

pytestmark = pytest.mark.slow

BASE = "smollm2-135m-instruct"


def test_a_batch_mixes_the_base_model_and_its_adapters(
    private_stack_settings: Settings, tmp_path: Path
) -> None:
    folders = save_smollm2_adapters(tmp_path, ["tone", "extract"], ["q_proj", "v_proj"])
    # "tone" from the object store (downloaded by the worker at start), "extract" from a local folder
    s3 = private_stack_settings.s3
    store = ObjectStore(s3)
    for file in folders["tone"].iterdir():
        store.put_bytes(f"lora-{tmp_path.name}/tone/{file.name}", file.read_bytes())
    settings = replace(
        private_stack_settings,
        lora_adapters=f"tone=s3://{s3.bucket}/{s3.prefix}lora-{tmp_path.name}/tone/,extract={folders['extract']}",
        lora_adapter_cache_dir=str(tmp_path / "adapter-cache"),
        model_aliases="ft:smollm2:acme::extract=extract",
    )
    with running_stack(settings, tmp_path / "stack") as stack:
        client = client_for(stack, stack.new_key("lora"))
        listed = {model.id: model for model in client.models.list()}
        assert {BASE, "tone", "extract", "ft:smollm2:acme::extract"} <= set(listed)
        assert listed["tone"].model_extra["parent"] == BASE and listed[BASE].model_extra["parent"] is None
        assert client.models.retrieve("ft:smollm2:acme::extract").model_extra["parent"] == BASE

        lines = [
            chat_line("base", "Say hello."),
            chat_line("tone", "Say hello.", model="tone"),
            chat_line("aliased", "Say hello.", model="ft:smollm2:acme::extract"),
            chat_line("base-named", "Say hello.", model=BASE),
            chat_line("unknown", "Say hello.", model="no-such-adapter"),
        ]
        upload = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
        batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h")
        done = wait_for(client, batch.id)
        assert done.status == "completed" and done.request_counts.completed == 4, done
        assert done.model == BASE  # a batch runs its base model, whichever of its adapters the first line names
        answers = {line["custom_id"]: line["response"]["body"] for line in read_jsonl(client, done.output_file_id)}
        assert {custom_id: body["model"] for custom_id, body in answers.items()} == {
            "base": BASE, "tone": "tone", "aliased": "extract", "base-named": BASE,
        }
        texts = {custom_id: body["choices"][0]["message"]["content"] for custom_id, body in answers.items()}
        assert texts["tone"] != texts["base"] and texts["aliased"] != texts["base"]
        errors = read_jsonl(client, done.error_file_id)
        assert [(e["custom_id"], e["error"]["code"]) for e in errors] == [("unknown", "model_not_found")]
    # the worker read "tone" from its download in the cache folder set
    assert [path.parent.name for path in (tmp_path / "adapter-cache").rglob("adapter_config.json")] == ["tone"]
