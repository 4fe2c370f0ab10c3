"""Tool calls end to end: the prompt as transformers renders it (tools and tool results included), and
required / named / auto answers from the engine, on a tiny random Qwen-style checkpoint with Qwen 2.5's
Hermes tool template, with the published Llama 3.2/3.3 and Mistral 7B v0.3/Nemo/Small 3.2 templates (chat_templates/), and on
SmolLM2 (no tool format: the generic one)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine import LLM
from engine.tokenizer import Tokenizer
from jobs.openai_format.records import response_record
from jobs.openai_format.requests import CHAT_COMPLETIONS, BatchRequest
from jobs.openai_format.validation import BatchLineValidator
from tests.conftest import save_random_hf_model
from tests.jobs.test_openai_format import SERVED
from tests.jobs.test_structured_lines import WEATHER_TOOL

pytestmark = pytest.mark.slow

# Qwen 2.5's chat template (tools in <tools>, calls in <tool_call>, results in <tool_response>)
QWEN_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n"
    "    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n"
    "    {%- endif %}\n"
    "    {{- \"\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n"
    "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>\" }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- \"\\n\" }}\n"
    "        {{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- \"\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments "
    "within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": "
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n"
    "{%- else %}\n"
    "    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if (message.role == \"user\") or (message.role == \"system\" and not loop.first) or "
    "(message.role == \"assistant\" and not message.tool_calls) %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n"
    "        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n"
    "            {{- '\\n' + message.content }}\n"
    "        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n"
    "            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n"
    "            {%- endif %}\n"
    "            {{- '\\n<tool_call>\\n{\"name\": \"' }}\n"
    "            {{- tool_call.name }}\n"
    "            {{- '\", \"arguments\": ' }}\n"
    "            {{- tool_call.arguments | tojson }}\n"
    "            {{- '}\\n</tool_call>' }}\n"
    "        {%- endfor %}\n"
    "        {{- '<|im_end|>\\n' }}\n"
    "    {%- elif message.role == \"tool\" %}\n"
    "        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != \"tool\") %}\n"
    "            {{- '<|im_start|>user' }}\n"
    "        {%- endif %}\n"
    "        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n"
    "        {{- '\\n</tool_response>' }}\n"
    "        {%- if loop.last or (messages[loop.index0 + 1].role != \"tool\") %}\n"
    "            {{- '<|im_end|>\\n' }}\n"
    "        {%- endif %}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "{%- endif %}\n"
)
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"type": "string", "enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER_TOOL, TIME_TOOL]
CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the weather in Paris, in Celsius?"},
]
WITH_RESULTS = [
    *CONVERSATION,
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "CET"}'}},
    ]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"time": "14:05"}'},
]


TEMPLATES = Path(__file__).parent / "chat_templates"
LLAMA_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>",
                "<|python_tag|>"]
MISTRAL_TOKENS = ["<s>", "</s>", "[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_CALLS]",
                  "[TOOL_RESULTS]", "[/TOOL_RESULTS]"]
# Llama's templates take one call per assistant turn; Mistral's take ids of 9 letters or digits (others are mapped,
# tests/jobs/test_tool_syntax.py), given here as they are so that transformers renders the same conversation.
LLAMA_WITH_RESULTS = [
    *CONVERSATION,
    {"role": "assistant", "content": None, "tool_calls": [WITH_RESULTS[2]["tool_calls"][0]]},
    WITH_RESULTS[3],
]
MISTRAL_WITH_RESULTS = [
    *CONVERSATION,
    {"role": "assistant", "content": None, "tool_calls": [
        {**call, "id": call_id} for call, call_id in zip(WITH_RESULTS[2]["tool_calls"], ["a1B2c3D4e", "f5G6h7I8j"])
    ]},
    {**WITH_RESULTS[3], "tool_call_id": "a1B2c3D4e"},
    {**WITH_RESULTS[4], "tool_call_id": "f5G6h7I8j"},
]
NATIVE = {  # published template → its (bos, eos) tokens and a conversation with tool results it takes
    "llama-3.2-3b-instruct": ("<|begin_of_text|>", "<|eot_id|>", LLAMA_WITH_RESULTS),
    "llama-3.3-70b-instruct": ("<|begin_of_text|>", "<|eot_id|>", LLAMA_WITH_RESULTS),
    "mistral-7b-instruct-v0.3": ("<s>", "</s>", MISTRAL_WITH_RESULTS),
    "mistral-nemo-instruct-2407": ("<s>", "</s>", MISTRAL_WITH_RESULTS),
    "mistral-small-3.2-24b-instruct-2506": ("<s>", "</s>", MISTRAL_WITH_RESULTS),
}


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory) -> Path:
    """A tiny random Qwen2 checkpoint with a byte-level BPE tokenizer (trained here, < 512 ids) and Qwen 2.5's
    tool-calling chat template."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    folder = save_random_hf_model("qwen2", tmp_path_factory.mktemp("qwen-tools"))
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 2048  # a few tools' JSON in a 480-token vocabulary is long
    (folder / "config.json").write_text(json.dumps(config))
    tokenizer = HFTokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2: eos is 2, as the model config says
    trainer = trainers.BpeTrainer(
        vocab_size=480, special_tokens=special, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    corpus = [QWEN_TEMPLATE, json.dumps(TOOLS), json.dumps(WITH_RESULTS)] * 3
    tokenizer.train_from_iterator(corpus, trainer)
    tokenizer.add_tokens(["<tool_call>", "</tool_call>"])
    tokenizer.add_special_tokens(LLAMA_TOKENS + MISTRAL_TOKENS)  # the Llama and Mistral templates' own tokens
    assert tokenizer.get_vocab_size() <= 512
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": QWEN_TEMPLATE,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


def chat_body(messages, **options) -> str:
    body = {"messages": messages, "tools": TOOLS, "max_tokens": 80, "temperature": 0, **options}
    return json.dumps({"custom_id": "line", "method": "POST", "url": CHAT_COMPLETIONS, "body": body})


def run_line(llm: LLM, line: str, tokenizer: Tokenizer | None = None) -> dict:
    """The line validated with `tokenizer` (the model's own by default: another one may bring another template), run
    and answered."""
    request = BatchLineValidator(tokenizer or llm.tokenizer, llm.max_model_len, models=SERVED).validate(line)
    assert isinstance(request, BatchRequest), request
    result = llm.generate(request.prompts, [request.sampling_params], use_tqdm=False)[0]
    record = response_record(request, [result], model=llm.model_name, tokenizer=llm.tokenizer)
    assert record.error is None, record.error
    return json.loads(record.model_dump_json())["response"]["body"]["choices"][0]


def assert_valid_calls(choice: dict, names: set[str], parallel: bool = True) -> list[dict]:
    import jsonschema

    assert choice["finish_reason"] == "tool_calls", choice
    calls = choice["message"]["tool_calls"]
    assert calls and (parallel or len(calls) == 1)
    schemas = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
    for call in calls:
        assert call["function"]["name"] in names
        jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
    return calls


def assert_prompt_equals_transformers(folder: Path, messages: list[dict]) -> str:
    import transformers

    hf = transformers.AutoTokenizer.from_pretrained(folder)
    hf_messages = [
        {**m, "tool_calls": [
            {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
            for c in m["tool_calls"]
        ]} if m.get("tool_calls") else {k: v for k, v in m.items() if v is not None}
        for m in messages
    ]
    expected = hf.apply_chat_template(hf_messages, tools=TOOLS, add_generation_prompt=True, tokenize=False)
    tokenizer = Tokenizer.from_folder(folder)
    request = BatchLineValidator(tokenizer, 2048, models=SERVED).validate(chat_body(messages))
    assert isinstance(request, BatchRequest), request
    assert request.prompts == [tokenizer.encode(expected, add_special_tokens=False)]
    return expected


@pytest.mark.parametrize("messages", [CONVERSATION, WITH_RESULTS], ids=["question", "with_tool_results"])
def test_qwen_prompt_equals_transformers(qwen_folder, messages):
    expected = assert_prompt_equals_transformers(qwen_folder, messages)
    assert "<tools>" in expected and ("<tool_response>" in expected) == (messages is WITH_RESULTS)


def native_folder(qwen_folder: Path, folder: Path, name: str) -> Path:
    """The Qwen fixture's tokenizer (it holds the Llama and Mistral tokens) under a published template."""
    bos, eos, _ = NATIVE[name]
    folder.mkdir(exist_ok=True)
    shutil.copy(qwen_folder / "tokenizer.json", folder)
    config = {"bos_token": bos, "eos_token": eos, "chat_template": (TEMPLATES / f"{name}.jinja").read_text(),
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize("with_results", [False, True], ids=["question", "with_tool_results"])
@pytest.mark.parametrize("name", NATIVE)
def test_llama_and_mistral_prompts_equal_transformers(qwen_folder, tmp_path, name, with_results):
    messages = NATIVE[name][2] if with_results else CONVERSATION
    expected = assert_prompt_equals_transformers(native_folder(qwen_folder, tmp_path / name, name), messages)
    tools_at = expected.index('"get_weather"')
    assert ("Environment: ipython" in expected) if name.startswith("llama") else ("[AVAILABLE_TOOLS]" in expected[:tools_at])
    if with_results:  # the earlier call and its result, in the template's own syntax
        assert CALL_IN_HISTORY[name] in expected


LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "C"}}<|eot_id|>'
MISTRAL_CALL = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}, "id": "a1B2c3D4e"}'
CALL_IN_HISTORY = {  # how each template writes the earlier call of MISTRAL/LLAMA_WITH_RESULTS
    "llama-3.2-3b-instruct": LLAMA_CALL,
    "llama-3.3-70b-instruct": LLAMA_CALL,
    "mistral-7b-instruct-v0.3": MISTRAL_CALL,
    "mistral-nemo-instruct-2407": MISTRAL_CALL,
    "mistral-small-3.2-24b-instruct-2506": '[TOOL_CALLS]get_weather[CALL_ID]a1B2c3D4e[ARGS]{"city": "Paris", "unit": "C"}',
}


@pytest.fixture(scope="module")
def qwen_llm(qwen_folder) -> LLM:
    return LLM(model=str(qwen_folder), dtype="float32", device="cpu")


def test_qwen_required_named_and_auto(qwen_llm):
    named = run_line(qwen_llm, chat_body(CONVERSATION, tool_choice={"type": "function", "function": {"name": "get_time"}}))
    assert [c["function"]["name"] for c in assert_valid_calls(named, {"get_time"}, parallel=False)] == ["get_time"]
    required = run_line(qwen_llm, chat_body(CONVERSATION, tool_choice="required", parallel_tool_calls=False))
    assert_valid_calls(required, {"get_weather", "get_time"}, parallel=False)
    # a random model rarely opens a call by itself: auto must still answer (content, or valid calls)
    auto = run_line(qwen_llm, chat_body(WITH_RESULTS, tool_choice="auto", max_tokens=20))
    if auto["message"].get("tool_calls"):
        assert_valid_calls(auto, {"get_weather", "get_time"})
    else:
        assert auto["finish_reason"] in ("stop", "length") and isinstance(auto["message"]["content"], str)


@pytest.mark.parametrize("name", ["llama-3.3-70b-instruct", "mistral-nemo-instruct-2407", "mistral-small-3.2-24b-instruct-2506"])
def test_llama_and_mistral_forced_calls_come_back_as_tool_calls(qwen_llm, name):
    """The random Qwen model prompted through a published Llama or Mistral template: a forced call is written in that
    template's syntax (Mistral's marker is a special token, gone from the text) and read back as a tool call."""
    bos, _, _ = NATIVE[name]
    template = (TEMPLATES / f"{name}.jinja").read_text()
    tokenizer = Tokenizer(qwen_llm.tokenizer.backend, {"bos_token": bos, "eos_token": "<|im_end|>"}, template)
    required = run_line(qwen_llm, chat_body(CONVERSATION, tool_choice="required", parallel_tool_calls=False), tokenizer)
    assert required["message"]["content"] is None
    assert_valid_calls(required, {"get_weather", "get_time"}, parallel=False)


@pytest.fixture(scope="module")
def smollm2_llm(smollm2_folder) -> LLM:
    return LLM(model=str(smollm2_folder), dtype="float32", device="cpu")


def test_smollm2_generic_format_required_named_and_auto(smollm2_llm):
    assert "<tool_call>" not in (smollm2_llm.tokenizer.chat_template or "")  # no native tool format
    request = BatchLineValidator(smollm2_llm.tokenizer, smollm2_llm.max_model_len, models=SERVED).validate(chat_body(CONVERSATION))
    prompt = smollm2_llm.tokenizer.decode(request.prompts[0], skip_special_tokens=False)
    assert "You can call these functions" in prompt and '"name": "get_weather"' in prompt

    required = run_line(smollm2_llm, chat_body(CONVERSATION, tool_choice="required"))
    calls = assert_valid_calls(required, {"get_weather", "get_time"})
    named = run_line(smollm2_llm, chat_body(CONVERSATION, tool_choice={"type": "function", "function": {"name": "get_weather"}}))
    (call,) = assert_valid_calls(named, {"get_weather"}, parallel=False)
    assert json.loads(call["function"]["arguments"])["city"]
    auto = run_line(smollm2_llm, chat_body(CONVERSATION, max_tokens=60))
    if auto["message"].get("tool_calls"):
        assert_valid_calls(auto, {"get_weather", "get_time"})
    else:
        assert isinstance(auto["message"]["content"], str)
    # the results go back in as user turns, and the model answers in text with tool_choice none
    final = run_line(smollm2_llm, chat_body(WITH_RESULTS, tool_choice="none", max_tokens=30))
    assert final["message"]["content"] and "tool_calls" not in final["message"]
    assert calls  # the required call's arguments validated above
