"""`conveyor run`: an OpenAI Batch input file in, one results line per input line out."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conveyor.cli import main
from conveyor.progress import ProgressLines
from engine import Embedder
from tests.engine.hf_oracle import tiny_llama_folder  # noqa: F401  (a fixture)
from tests.lora_adapters import save_smollm2_adapters


def request_line(custom_id: str, url: str, body: dict[str, Any]) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body})


def image_data_url(size: tuple[int, int]) -> str:
    from PIL import Image

    out = io.BytesIO()
    Image.new("L", size).save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


def image_line(custom_id: str, url: str, image_url: str) -> str:
    content = [{"type": "text", "text": "Describe it."}, {"type": "image_url", "image_url": {"url": image_url}}]
    return request_line(custom_id, url, {"messages": [{"role": "user", "content": content}], "max_tokens": 4})


def test_a_missing_input_file_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    exit_code = main(["run", "-i", str(tmp_path / "absent.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    assert exit_code == 1
    stderr = capsys.readouterr().err
    assert "input file not found" in stderr and "absent.jsonl" in stderr
    assert "Traceback" not in stderr
    assert not (tmp_path / "out.jsonl").exists()


def test_a_missing_output_folder_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(request_line("a", "/v1/completions", {"prompt": "hi"}) + "\n")
    exit_code = main(["run", "-i", str(source), "-o", str(tmp_path / "missing" / "out.jsonl")])
    assert exit_code == 1
    assert "output folder does not exist" in capsys.readouterr().err


def test_input_and_output_are_required(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["run"])
    assert exited.value.code == 2
    assert "-i/--input" in capsys.readouterr().err


def test_progress_lines_are_whole_lines_with_the_count_and_the_last_one_on_close() -> None:
    sink = io.StringIO()
    progress = ProgressLines(total=3, desc="requests", unit="req", file=sink)
    for _ in range(3):
        progress.update(1)  # within LOG_LINE_INTERVAL_S of the first line: no line of its own
    progress.close()
    lines = sink.getvalue().splitlines()
    assert "\r" not in sink.getvalue()
    assert [line.split("[")[0] for line in lines] == ["requests:   0% 0/3 ", "requests: 100% 3/3 "]
    assert "ETA" in lines[-1]


@pytest.mark.slow
def test_run_answers_every_line_once_with_the_real_engine(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    chat = "/v1/chat/completions"
    lines = [
        request_line("chat-ok", chat, {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 8,
                                       "temperature": 0}),
        "{this is not json",
        request_line("text-ok", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6,
                                                    "temperature": 0, "logprobs": 2}),
        request_line("bad-temperature", chat, {"messages": [{"role": "user", "content": "Hi"}], "temperature": -1}),
        "",  # blank lines carry no request and get no output line
        request_line("bad-url", "/v1/moderations", {"input": "Hi"}),
        request_line("chat-logprobs", chat, {"messages": [{"role": "user", "content": "Count to three."}],
                                             "max_completion_tokens": 5, "temperature": 0, "logprobs": True,
                                             "top_logprobs": 2}),
        request_line("too-long", "/v1/completions", {"prompt": "word " * 50_000, "max_tokens": 4}),
        request_line("two-samples", chat, {"messages": [{"role": "user", "content": "Name a fruit."}], "max_tokens": 6,
                                           "n": 2, "seed": 3}),
        request_line("two-prompts-echo", "/v1/completions", {"prompt": ["The capital of France is", "One, two,"],
                                                             "max_tokens": 2, "temperature": 0, "echo": True,
                                                             "logprobs": 1}),
        # Image lines: read in full, then refused by the text-only model, or failed by their image's own code
        image_line("image-png", chat, image_data_url((8, 8))),
        image_line("image-svg", chat, "data:image/svg+xml;base64," + base64.b64encode(b"<svg/>").decode()),
        image_line("image-private", chat, "https://127.0.0.1/cat.png"),
        request_line("image-strip", "/v1/responses", {"input": [{"role": "user", "content": [
            {"type": "input_text", "text": "What is it?"},
            {"type": "input_image", "image_url": image_data_url((1, 100_000)), "detail": "low"},
        ]}]}),
    ]
    source, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n")

    exit_code = main(["run", "-i", str(source), "-o", str(results), "--max-num-seqs", "8"])

    assert exit_code == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [record["custom_id"] for record in records] == [
        "chat-ok", None, "text-ok", "bad-temperature", "bad-url", "chat-logprobs", "too-long", "two-samples",
        "two-prompts-echo", "image-png", "image-svg", "image-private", "image-strip",
    ]
    by_id = {record["custom_id"]: record for record in records}

    for custom_id in ("chat-ok", "text-ok", "chat-logprobs", "two-samples", "two-prompts-echo"):
        record = by_id[custom_id]
        assert record["error"] is None
        assert record["id"].startswith("batch_req_")
        body = record["response"]["body"]
        assert record["response"]["status_code"] == 200
        assert body["model"] == "smollm2-135m-instruct"
        assert body["usage"]["prompt_tokens"] > 0
        assert body["usage"]["completion_tokens"] >= len(body["choices"])
        for choice in body["choices"]:
            assert choice["finish_reason"] in ("stop", "length")

    chat_body = by_id["chat-ok"]["response"]["body"]
    assert chat_body["object"] == "chat.completion"
    assert chat_body["choices"][0]["message"]["role"] == "assistant"
    assert chat_body["choices"][0]["message"]["content"].strip()

    text_body = by_id["text-ok"]["response"]["body"]
    assert text_body["object"] == "text_completion"
    text_choice = text_body["choices"][0]
    assert text_choice["text"].strip()
    assert len(text_choice["logprobs"]["tokens"]) == text_body["usage"]["completion_tokens"]
    assert all(len(top) >= 2 for top in text_choice["logprobs"]["top_logprobs"])

    token_logprobs = by_id["chat-logprobs"]["response"]["body"]["choices"][0]["logprobs"]["content"]
    assert token_logprobs and all(len(entry["top_logprobs"]) == 2 for entry in token_logprobs)
    assert [choice["index"] for choice in by_id["two-samples"]["response"]["body"]["choices"]] == [0, 1]

    echoed = by_id["two-prompts-echo"]["response"]["body"]["choices"]  # one choice per prompt, prompt first
    assert [choice["text"][:9] for choice in echoed] == ["The capit", "One, two,"]
    for choice in echoed:
        scored = choice["logprobs"]
        assert "".join(scored["tokens"]) == choice["text"]
        assert scored["token_logprobs"][0] is None and scored["top_logprobs"][0] is None
        assert all(logprob <= 0 for logprob in scored["token_logprobs"][1:])
        assert scored["text_offset"][-1] + len(scored["tokens"][-1]) == len(choice["text"])

    errors = {record["custom_id"]: record["error"] for record in records if record["error"] is not None}
    assert errors[None]["code"] == "invalid_json_line"
    assert errors["bad-temperature"] == {"code": "invalid_parameter", "message": "temperature must be >= 0, got -1.0"}
    assert errors["bad-url"]["code"] == "invalid_url"
    assert errors["too-long"]["code"] == "context_length_exceeded"
    assert errors["image-png"]["code"] == "model_not_multimodal" and "reads text only" in errors["image-png"]["message"]
    assert errors["image-svg"]["code"] == "image_format_unsupported"
    assert errors["image-private"]["code"] == "image_fetch_failed" and "loopback" in errors["image-private"]["message"]
    assert errors["image-strip"]["code"] == "image_too_large"
    assert all(record["response"] is None for record in records if record["error"] is not None)

    stderr = capsys.readouterr().err.strip().splitlines()  # not a terminal here: progress as whole lines
    assert stderr[0].startswith("conveyor run: loading smollm2-135m-instruct")
    assert "\r" not in "".join(stderr)
    assert any(line.startswith("requests: 100% 6/6 [") and "output tok/s" in line for line in stderr)
    summary = stderr[-1]
    assert "13 requests, 5 succeeded, 8 failed" in summary
    assert "1 invalid_json_line" in summary and str(results) in summary


@pytest.mark.slow
def test_run_answers_embedding_lines_with_the_embedding_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    embeddings = "/v1/embeddings"
    lines = [
        request_line("one", embeddings, {"input": "The cat sat on the mat.", "model": "all-minilm-l6-v2"}),
        request_line("two", embeddings, {"input": ["first passage", "second passage"], "encoding_format": "base64"}),
        request_line("token-ids", embeddings, {"input": [101, 2023, 102]}),
        request_line("text", "/v1/completions", {"prompt": "Once upon a time", "max_tokens": 4}),  # files may mix urls
        request_line("other-dimensions", embeddings, {"input": "x", "dimensions": 64}),
        request_line("empty", embeddings, {"input": []}),
    ]
    source, results = tmp_path / "embeddings.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n")

    exit_code = main(["run", "-i", str(source), "-o", str(results), "--dtype", "float32", "--device", "cpu"])

    assert exit_code == 0
    records = [json.loads(line) for line in results.read_text().splitlines()]
    assert [record["custom_id"] for record in records] == [
        "one", "two", "token-ids", "text", "other-dimensions", "empty",
    ]
    by_id = {record["custom_id"]: record for record in records}
    texts = ["The cat sat on the mat.", "first passage", "second passage"]
    expected = Embedder(dtype="float32", device="cpu").embed(texts)
    one = by_id["one"]["response"]["body"]
    assert (one["object"], one["model"]) == ("list", "all-minilm-l6-v2")
    two = by_id["two"]["response"]["body"]
    vectors = np.array(
        [one["data"][0]["embedding"]]
        + [np.frombuffer(base64.b64decode(item["embedding"]), dtype="<f4") for item in two["data"]],
        dtype=np.float32,
    )
    cosine = np.sum(vectors * expected.vectors, axis=1) / np.linalg.norm(vectors, axis=1)  # expected rows: unit length
    assert cosine.min() >= 0.9999
    assert one["usage"]["total_tokens"] == expected.token_counts[0]
    assert two["usage"]["prompt_tokens"] == sum(expected.token_counts[1:])
    assert by_id["text"]["response"]["body"]["object"] == "text_completion"
    errors = {record["custom_id"]: record["error"]["code"] for record in records if record["error"] is not None}
    assert errors == {
        "token-ids": "invalid_body", "other-dimensions": "invalid_parameter", "empty": "invalid_parameter",
    }
    assert "6 requests, 3 succeeded, 3 failed" in capsys.readouterr().err


def test_an_unknown_embedding_model_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "in.jsonl"
    source.write_text(request_line("a", "/v1/embeddings", {"input": "hi"}) + "\n")
    exit_code = main(
        ["run", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--embedding-model", str(tmp_path / "absent")]
    )
    assert exit_code == 1
    stderr = capsys.readouterr().err
    assert "cannot load embedding model" in stderr and "Traceback" not in stderr
    assert not (tmp_path / "out.jsonl").exists()


@pytest.mark.slow
def test_run_answers_responses_lines_with_objects_the_sdk_parses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from openai.types.chat import ChatCompletion
    from openai.types.responses import Response

    responses, chat = "/v1/responses", "/v1/chat/completions"
    lines = [
        request_line("resp-text", responses, {"model": "gpt-4o-mini", "input": "Say hello.", "instructions": "Be brief.",
                                              "max_output_tokens": 4, "temperature": 0, "store": False}),
        request_line("resp-items", responses, {"model": "smollm2-135m-instruct", "max_output_tokens": 30,
                                               "input": [{"role": "user", "content": [{"type": "input_text",
                                                                                        "text": "Name a color."}]}]}),
        request_line("resp-stored", responses, {"input": "Hi", "previous_response_id": "resp_abc"}),
        request_line("chat-alias", chat, {"model": "gpt-4o-mini", "messages": [{"role": "user", "content": "Hi"}],
                                          "max_tokens": 3, "stream": False, "store": True, "service_tier": "auto"}),
        request_line("chat-unknown-model", chat, {"model": "gpt-4.1", "messages": [{"role": "user", "content": "Hi"}]}),
    ]
    source, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n")

    exit_code = main(
        ["run", "-i", str(source), "-o", str(results), "--model-alias", "gpt-4o-mini=smollm2-135m-instruct", "--quiet"]
    )

    assert exit_code == 0
    assert capsys.readouterr().err == ""  # --quiet: no progress, no summary
    by_id = {record["custom_id"]: record for record in map(json.loads, results.read_text().splitlines())}
    first = Response.model_validate(by_id["resp-text"]["response"]["body"])
    assert (first.status, first.incomplete_details.reason) == ("incomplete", "max_output_tokens")  # type: ignore[union-attr]
    assert first.usage is not None and first.usage.output_tokens == 4 and first.output_text
    second = Response.model_validate(by_id["resp-items"]["response"]["body"])
    assert second.model == "smollm2-135m-instruct" and second.output[0].type == "message"
    assert by_id["resp-stored"]["error"]["code"] == "invalid_body"
    assert ChatCompletion.model_validate(by_id["chat-alias"]["response"]["body"]).choices[0].message.content
    assert by_id["chat-unknown-model"]["error"]["code"] == "model_not_found"


def test_run_serves_lora_adapters_beside_the_base_model(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Lines of the base model and of two adapters (one through an `ft:`-style alias) in one file: each answered by
    what it names, and greedy output of an adapter line differs from the base's; an unknown adapter is
    model_not_found, not the base model."""
    save_smollm2_adapters(tmp_path, ["tone", "extract"], ["q_proj", "v_proj", "down_proj"])
    chat = "/v1/chat/completions"
    body = {"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 6, "temperature": 0}
    lines = [
        request_line("base", chat, body),
        request_line("tone", chat, {**body, "model": "tone"}),
        request_line("aliased", chat, {**body, "model": "ft:smollm2:acme::extract"}),
        request_line("unknown", chat, {**body, "model": "no-such-adapter"}),
    ]
    source, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    source.write_text("\n".join(lines) + "\n")

    exit_code = main([
        "run", "-i", str(source), "-o", str(results), "--lora-adapter", f"tone={tmp_path / 'tone'}",
        "--lora-adapter", f"extract={tmp_path / 'extract'}", "--model-alias", "ft:smollm2:acme::extract=extract",
        "--dtype", "float32",
    ])

    assert exit_code == 0
    by_id = {record["custom_id"]: record for record in map(json.loads, results.read_text().splitlines())}
    models = {custom_id: by_id[custom_id]["response"]["body"]["model"] for custom_id in ("base", "tone", "aliased")}
    assert models == {"base": "smollm2-135m-instruct", "tone": "tone", "aliased": "extract"}
    texts = {custom_id: by_id[custom_id]["response"]["body"]["choices"][0]["message"]["content"] for custom_id in models}
    assert texts["tone"] != texts["base"] and texts["aliased"] != texts["base"]
    assert by_id["unknown"]["error"]["code"] == "model_not_found"


def test_run_refuses_a_bad_adapter_before_reading_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_text(request_line("a", "/v1/completions", {"prompt": "Hi", "max_tokens": 2}) + "\n")
    (tmp_path / "not-an-adapter").mkdir()
    exit_code = main(["run", "-i", str(source), "-o", str(tmp_path / "out.jsonl"),
                      "--lora-adapter", f"x={tmp_path / 'not-an-adapter'}"])
    assert exit_code != 0
    assert "not a PEFT LoRA adapter folder" in capsys.readouterr().err


def test_run_passes_quantized_activations_to_the_engine(
    tmp_path: Path, tiny_llama_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = tmp_path / "requests.jsonl"
    source.write_text(request_line("a", "/v1/completions", {"prompt": [5, 6], "max_tokens": 2}) + "\n")
    # an unquantized folder: the engine refuses the ask by name rather than ignore it
    exit_code = main(["run", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--model", str(tiny_llama_folder),
                      "--quantized-activations", "int8"])
    assert exit_code != 0
    assert "quantized_activations='int8' applies to weights the CPU kernels run quantized" in capsys.readouterr().err


def png_data_url(picture: Any, truncate: bool = False) -> str:
    out = io.BytesIO()
    picture.save(out, format="PNG")
    data = out.getvalue()[: 60 if truncate else None]
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.mark.slow
def test_run_answers_image_lines_with_a_vision_model(tmp_path: Path, llava_folder: Path) -> None:
    """Image lines on a tiny LLaVA-1.5 folder, mixed with text lines: each answers as transformers' `generate` with
    the folder's processor does, token for token, its usage counts the images' placeholder tokens, sampling fields
    (logprobs, n, min_tokens) hold as on text lines, and a corrupt image fails its line alone."""
    import torch
    import transformers

    from bench.vision_models import image

    chat = "/v1/chat/completions"
    one, two, three = image(1, 40, 33), image(2, 25, 60), image(3, 90, 31)
    greedy = {"temperature": 0, "max_tokens": 6, "min_tokens": 6, "logprobs": True, "top_logprobs": 2}

    def picture_line(custom_id: str, text: str, pictures: list[Any], **extra: Any) -> str:
        parts = [{"type": "text", "text": text}] + [
            {"type": "image_url", "image_url": {"url": png_data_url(p)}} for p in pictures
        ]
        return request_line(custom_id, chat, {"messages": [{"role": "user", "content": parts}], **greedy, **extra})

    lines = [
        picture_line("one", "describe this picture", [one]),
        request_line("text", chat, {"messages": [{"role": "user", "content": "hello there"}], **greedy}),
        picture_line("two", "compare the two pictures", [two, three], n=2),
        request_line("corrupt", chat, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": png_data_url(one, truncate=True)}}]}]}),
        picture_line("other", "describe this picture", [three]),
    ]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")

    assert main(["run", "-i", str(source), "-o", str(results), "--model", str(llava_folder), "--dtype", "float32"]) == 0
    by_id = {record["custom_id"]: record for record in map(json.loads, results.read_text().splitlines())}

    assert by_id["corrupt"]["error"]["code"] == "image_unreadable"
    processor = transformers.AutoProcessor.from_pretrained(llava_folder)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava_folder, dtype=torch.float32).eval()
    answers = {}
    for custom_id, text, pictures in [
        ("one", "describe this picture", [one]), ("two", "compare the two pictures", [two, three]),
        ("text", "hello there", []), ("other", "describe this picture", [three]),
    ]:
        parts = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
        inputs = processor(images=pictures or None, text=prompt, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        expected = processor.tokenizer.convert_ids_to_tokens(output[0, inputs["input_ids"].shape[1]:].tolist())
        body = by_id[custom_id]["response"]["body"]
        assert body["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1], custom_id  # with the placeholders
        for choice in body["choices"]:
            assert [entry["token"] for entry in choice["logprobs"]["content"]] == expected, custom_id
            assert all(len(entry["top_logprobs"]) == 2 for entry in choice["logprobs"]["content"])
        answers[custom_id] = expected
    assert len(by_id["two"]["response"]["body"]["choices"]) == 2
    assert answers["one"] != answers["other"], "the tiny model should tell the images apart"


@pytest.mark.slow
def test_run_answers_image_lines_with_qwen2_5_vl(tmp_path: Path, qwen2_5_vl_folder: Path) -> None:
    """Image lines on a tiny Qwen2.5-VL folder (images of three sizes: 6, 6 + 18 placeholder tokens), mixed with a
    text line: each answers as transformers' `generate` with the model's processor does, token for token, and its
    usage counts the placeholders its images' sizes give."""
    import torch
    import transformers

    from bench.vision_models import image, qwen_processor

    chat = "/v1/chat/completions"
    wide, small, tall = image(1, 56, 84), image(2, 40, 33), image(3, 200, 90)
    greedy = {"temperature": 0, "max_tokens": 6, "min_tokens": 6, "logprobs": True}
    cases = [("one", "describe this picture", [wide]), ("two", "compare the two pictures", [small, tall]),
             ("text", "hello there", [])]
    lines = []
    for custom_id, text, pictures in cases:
        parts = [{"type": "image_url", "image_url": {"url": png_data_url(p)}} for p in pictures]
        parts.append({"type": "text", "text": text})
        lines.append(request_line(custom_id, chat, {"messages": [{"role": "user", "content": parts}], **greedy}))
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")
    command = ["run", "-i", str(source), "-o", str(results), "--model", str(qwen2_5_vl_folder), "--dtype", "float32"]
    assert main(command) == 0
    by_id = {record["custom_id"]: record for record in map(json.loads, results.read_text().splitlines())}

    processor = qwen_processor(qwen2_5_vl_folder)
    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(qwen2_5_vl_folder, dtype=torch.float32)
    for custom_id, text, pictures in cases:
        parts = [{"type": "image"} for _ in pictures] + [{"type": "text", "text": text}]
        prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
        inputs = processor(images=pictures or None, text=prompt, return_tensors="pt")
        output = model.eval().generate(**inputs, max_new_tokens=6, min_new_tokens=6, do_sample=False)
        expected = processor.tokenizer.convert_ids_to_tokens(output[0, inputs["input_ids"].shape[1]:].tolist())
        body = by_id[custom_id]["response"]["body"]
        assert body["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1], custom_id  # with the placeholders
        assert [entry["token"] for entry in body["choices"][0]["logprobs"]["content"]] == expected, custom_id


@pytest.mark.slow
def test_run_answers_image_lines_with_gemma3(tmp_path: Path, gemma3_folder: Path) -> None:
    """Image lines on a tiny Gemma 3 folder (its template keeps the parts' order: text, then images), beside a text
    line: each answers as transformers' `generate` with the folder's processor does, and its usage counts the
    placeholders and the tokens the processor writes around them."""
    import torch
    import transformers

    from bench.vision_models import image

    chat = "/v1/chat/completions"
    one, two = image(1, 40, 33), image(2, 25, 60)
    greedy = {"temperature": 0, "max_tokens": 5, "min_tokens": 5}
    cases = [("one", "describe this picture", [one]), ("text", "hello there", []), ("two", "compare", [one, two])]
    lines = [
        request_line(custom_id, chat, {"messages": [{"role": "user", "content": [{"type": "text", "text": text}] + [
            {"type": "image_url", "image_url": {"url": png_data_url(p)}} for p in pictures]}], **greedy})
        for custom_id, text, pictures in cases
    ]
    source, results = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")

    assert main(["run", "-i", str(source), "-o", str(results), "--model", str(gemma3_folder), "--dtype", "float32"]) == 0
    by_id = {record["custom_id"]: record for record in map(json.loads, results.read_text().splitlines())}
    processor = transformers.AutoProcessor.from_pretrained(gemma3_folder)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3_folder, dtype=torch.float32).eval()
    for custom_id, text, pictures in cases:
        parts = [{"type": "text", "text": text}] + [{"type": "image"} for _ in pictures]
        prompt = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True)
        inputs = processor(images=pictures or None, text=prompt, return_tensors="pt")
        output = model.generate(**inputs, max_new_tokens=5, min_new_tokens=5, do_sample=False)
        expected = processor.tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        body = by_id[custom_id]["response"]["body"]
        assert body["usage"]["prompt_tokens"] == inputs["input_ids"].shape[1], custom_id
        assert expected and body["choices"][0]["message"]["content"] == expected, custom_id
