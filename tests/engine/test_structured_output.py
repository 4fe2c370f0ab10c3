"""Structured output: constrained decoding with xgrammar in the engine.

The oracle: greedy output equals Hugging Face `generate` with xgrammar's own logits processor over the
same grammar, token for token in float32, whatever batching, chunked prefill, preemption or prefix
caching happened. Every output that stops validates against its schema (`jsonschema` as the judge).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine import LLM, SamplingParams
from engine.sampler import SamplingRow, process_logits
from engine.structured_output import StructuredOutputParams
from conveyor_kernels.cpu_kernels import load_cpu_kernels
from tests.conftest import hf_smollm2
from tests.engine.test_hf_equivalence import check_setup_exercised

ADDRESS = {
    "type": "object",
    "properties": {
        "street": {"type": "string", "maxLength": 40},
        "city": {"type": "string", "maxLength": 30},
        "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
        "country": {"type": "string", "enum": ["FR", "DE", "ES", "IT", "UK"]},
    },
    "required": ["street", "city", "postcode", "country"],
    "additionalProperties": False,
}
SCHEMAS: dict[str, dict] = {
    "flat": {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0, "maximum": 130}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "nested_ref": {
        "$defs": {"address": ADDRESS},
        "type": "object",
        "properties": {"company": {"type": "string", "maxLength": 30}, "office": {"$ref": "#/$defs/address"}},
        "required": ["company", "office"],
        "additionalProperties": False,
    },
    "array_enum": {
        "type": "object",
        "properties": {
            "colours": {
                "type": "array", "minItems": 1, "maxItems": 3,
                "items": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
            },
            "count": {"type": "integer", "minimum": 1, "maximum": 3},
        },
        "required": ["colours", "count"],
        "additionalProperties": False,
    },
    "any_of_const": {
        "type": "object",
        "properties": {
            "kind": {"const": "measurement"},
            "value": {"anyOf": [{"type": "number", "minimum": -50, "maximum": 60}, {"type": "null"}]},
            "unit": {"type": "string", "enum": ["C", "F"]},
        },
        "required": ["kind", "value", "unit"],
        "additionalProperties": False,
    },
    "pattern_bool": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "active": {"type": "boolean"},
            "date": {"type": "string", "format": "date"},
        },
        "required": ["code", "active", "date"],
        "additionalProperties": False,
    },
}
PROMPTS = [
    "Extract the data as JSON: Marie Curie, 66 years old, lived at 11 rue Pierre et Marie Curie, 75005 Paris, France.",
    "Return JSON describing the weather: it is 21 degrees Celsius and the sky is blue.",
    "Produce a JSON record for the product code ABC-12, active since 2024-02-29.",
    "Give me a JSON answer about Acme Corp, whose office is at 5 Hauptstrasse, 10115 Berlin, Germany.",
]
MAX_TOKENS = 60


def chat_prompts(tokenizer) -> list[list[int]]:
    return [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": p}]), add_special_tokens=False)
        for p in PROMPTS
    ]


def constrained(schema: dict, **options) -> SamplingParams:
    options = {"temperature": 0.0, "max_tokens": MAX_TOKENS, **options}
    return SamplingParams(structured_output=StructuredOutputParams(json_schema=schema), **options)


def assert_valid(text: str, schema: dict) -> None:
    import jsonschema

    jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)


# ---- plain data and the sampler (no model) ------------------------------------------------------


def test_params_take_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputParams(regex="a+", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputParams(json_schema="{nope")
    assert StructuredOutputParams(json_schema='{"type": "object"}').key == ("json_schema", '{"type":"object"}')
    # property order is part of the grammar, so it is part of the key
    a = StructuredOutputParams(json_schema={"properties": {"a": {}, "b": {}}})
    b = StructuredOutputParams(json_schema={"properties": {"b": {}, "a": {}}})
    assert a.key != b.key


@pytest.mark.parametrize(
    "options, message",
    [
        ({"use_beam_search": True, "n": 2, "temperature": 0.0}, "beam search"),
        ({"ignore_eos": True}, "ignore_eos"),
        ({"min_tokens": 3}, "min_tokens"),
    ],
)
def test_unsupported_combinations_are_refused(options, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(structured_output=StructuredOutputParams(json_object=True), **options)


def test_logit_bias_is_validated():
    with pytest.raises(ValueError, match=r"\[-100, 100\]"):
        SamplingParams(logit_bias={5: 101})
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(logit_bias={-1: 1})
    assert SamplingParams(logit_bias={"7": -3}).logit_bias == {7: -3.0}  # JSON keys arrive as strings


def _row(**options) -> SamplingRow:
    return SamplingRow(SamplingParams(**options), seed=0, prompt_token_ids=[1], output_token_ids=[], eos_token_ids=[0])


# A string condition: evaluated when the test runs, so collecting builds no C++ kernels.
@pytest.mark.parametrize(
    "cpu_kernels",
    [False, pytest.param(True, marks=pytest.mark.skipif("load_cpu_kernels() is None", reason="no C++ compiler"))],
    ids=["xgrammar", "cpu_kernels"],
)
@pytest.mark.parametrize("vocab", [100, 49152])
def test_bitmask_and_logit_bias_match_a_reference(cpu_kernels: bool, vocab: int):
    torch.manual_seed(0)
    logits = torch.randn(3, vocab)
    rows = [_row(logit_bias={3: 100.0, 50: -100.0, 99: 2.5}), _row(), _row(logit_bias={0: -1.0})]
    allowed = torch.rand(3, vocab) < 0.3
    allowed[1] = True  # an unconstrained row: every bit set
    allowed[2, 32:96] = False  # whole disallowed words
    words = -(-vocab // 32)
    bits = torch.zeros(3, words * 32, dtype=torch.int64)
    bits[:, :vocab] = allowed.long()
    packed = (bits.view(3, words, 32) << torch.arange(32)).sum(-1)
    bitmask = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)

    got = process_logits(logits, rows, bitmask, cpu_kernels)

    expected = logits.masked_fill(~allowed, -math.inf)
    for r, row in enumerate(rows):
        for token, bias in row.params.logit_bias.items():
            if allowed[r, token]:
                expected[r, token] += bias
    assert torch.equal(got, expected)
    assert not torch.equal(logits, got)  # the input is left alone


# ---- SmolLM2 ---------------------------------------------------------------------------------------

pytest_slow = pytest.mark.slow


@pytest.fixture(scope="module")
def smollm2(smollm2_folder):
    return LLM(model=str(smollm2_folder), dtype="float32", device="cpu")


@pytest_slow
def test_every_schema_and_prompt_gives_valid_json(smollm2):
    prompts = chat_prompts(smollm2.tokenizer)
    cases = [(name, prompt) for name in SCHEMAS for prompt in prompts]
    params = [constrained(SCHEMAS[name], max_tokens=100) for name, _ in cases]
    outputs = smollm2.generate([prompt for _, prompt in cases], params, use_tqdm=False)
    finished = 0
    for (name, _), output in zip(cases, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason in ("stop", "length")
        if completion.finish_reason == "stop":
            assert_valid(completion.text, SCHEMAS[name])
            finished += 1
    assert finished >= len(cases) * 3 // 4
    assert smollm2.engine.grammar_compilations == len(SCHEMAS)


@pytest_slow
def test_max_tokens_cut_off_is_length(smollm2):
    prompt = chat_prompts(smollm2.tokenizer)[0]
    output = smollm2.generate([prompt], constrained(SCHEMAS["nested_ref"], max_tokens=5), use_tqdm=False)[0]
    assert output.outputs[0].finish_reason == "length" and len(output.outputs[0].token_ids) == 5


@pytest_slow
def test_other_constraints(smollm2):
    prompt = chat_prompts(smollm2.tokenizer)[1]
    cases = {
        "choice": StructuredOutputParams(choice=["sunny", "cloudy", "rainy"]),
        "regex": StructuredOutputParams(regex=r"[0-9]{1,2} degrees (Celsius|Fahrenheit)"),
        "json_object": StructuredOutputParams(json_object=True),
        "grammar": StructuredOutputParams(grammar='root ::= "The sky is " ("blue" | "grey") "."'),
    }
    params = [SamplingParams(temperature=0.0, max_tokens=60, structured_output=c) for c in cases.values()]
    outputs = dict(zip(cases, smollm2.generate([prompt] * len(cases), params, use_tqdm=False)))
    assert {o.outputs[0].finish_reason for o in outputs.values()} == {"stop"}
    assert outputs["choice"].outputs[0].text in ("sunny", "cloudy", "rainy")
    import re

    assert re.fullmatch(r"[0-9]{1,2} degrees (Celsius|Fahrenheit)", outputs["regex"].outputs[0].text)
    assert isinstance(json.loads(outputs["json_object"].outputs[0].text), dict)
    assert outputs["grammar"].outputs[0].text in ("The sky is blue.", "The sky is grey.")


@pytest_slow
def test_sampled_parallel_samples_each_keep_their_own_state(smollm2):
    """n = 4 sampled samples fork one prompt's matcher; each output is valid on its own."""
    prompt = chat_prompts(smollm2.tokenizer)[2]
    schema = SCHEMAS["pattern_bool"]
    output = smollm2.generate([prompt], constrained(schema, n=4, temperature=1.0, seed=3, max_tokens=80), use_tqdm=False)[0]
    texts = [c.text for c in output.outputs if c.finish_reason == "stop"]
    assert len(texts) >= 3 and len(set(texts)) > 1
    for text in texts:
        assert_valid(text, schema)


@pytest_slow
def test_stop_string_ends_a_constrained_sample(smollm2):
    prompt = chat_prompts(smollm2.tokenizer)[0]
    output = smollm2.generate([prompt], constrained(SCHEMAS["flat"], stop=['"age"']), use_tqdm=False)[0].outputs[0]
    assert output.finish_reason == "stop" and output.stop_reason == '"age"'
    assert output.text.startswith('{"name": ') and '"age"' not in output.text


@pytest_slow
def test_a_bad_constraint_fails_its_own_request_only(smollm2):
    prompt = chat_prompts(smollm2.tokenizer)[0]
    params = [
        SamplingParams(max_tokens=5, structured_output=StructuredOutputParams(regex="(unclosed")),
        constrained(SCHEMAS["flat"]),
    ]
    bad, good = smollm2.generate([prompt, prompt], params, use_tqdm=False)
    assert bad.error and "regex" in bad.error and bad.outputs[0].finish_reason == "abort"
    assert good.error is None and good.outputs[0].finish_reason == "stop"
    assert_valid(good.outputs[0].text, SCHEMAS["flat"])


@pytest_slow
def test_one_schema_compiles_once(smollm2):
    before = smollm2.engine.grammar_compilations
    prompts = chat_prompts(smollm2.tokenizer)
    schema = {**SCHEMAS["flat"], "title": "compile-once"}  # a key no other test used
    smollm2.generate(prompts * 3, constrained(schema, max_tokens=8), use_tqdm=False)
    assert smollm2.engine.grammar_compilations == before + 1


@pytest_slow
def test_logit_bias_changes_greedy_choice(smollm2):
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.encode("The capital of France is")
    first = smollm2.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)[0]
    banned = first.outputs[0].token_ids[0]
    forced = tokenizer.encode(" banana", add_special_tokens=False)[0]
    params = [
        SamplingParams(temperature=0.0, max_tokens=1, logit_bias={banned: -100}),
        SamplingParams(temperature=0.0, max_tokens=1, logit_bias={forced: 100}),
    ]
    without, pushed = smollm2.generate([prompt, prompt], params, use_tqdm=False)
    assert without.outputs[0].token_ids[0] != banned
    assert pushed.outputs[0].token_ids == [forced]


@pytest_slow
def test_jump_forward_skips_forward_passes_and_stays_valid(smollm2_folder):
    llm = LLM(model=str(smollm2_folder), dtype="float32", device="cpu", jump_forward=True)
    prompts = chat_prompts(llm.tokenizer)
    outputs = llm.generate(prompts, constrained(SCHEMAS["nested_ref"], max_tokens=100), use_tqdm=False)
    assert llm.engine.jump_forward_tokens > 10
    for output in outputs:
        if output.outputs[0].finish_reason == "stop":
            assert_valid(output.outputs[0].text, SCHEMAS["nested_ref"])


# ---- the oracle: HF generate with xgrammar's logits processor --------------------------------------

ORACLE_SCHEMAS = ["nested_ref", "array_enum", "any_of_const", "pattern_bool"]
ORACLE_SETUPS = {
    "default": {},
    "chunked_prefill": {"max_num_batched_tokens": 16},
    # 48 blocks of 4 tokens cannot hold every sequence at once: preemption
    "preemption_swap": {"block_size": 4, "num_kv_blocks": 48, "max_num_batched_tokens": 64, "preemption_mode": "swap"},
    "preemption_recompute": {
        "block_size": 4, "num_kv_blocks": 48, "max_num_batched_tokens": 64, "preemption_mode": "recompute"
    },
    "prefix_caching": {"max_num_seqs": 2, "enable_prefix_caching": True},
}


@pytest.fixture(scope="module")
def oracle_case(smollm2_folder):
    """Each (schema, prompt) pair's greedy tokens from HF generate + xgrammar.contrib.hf.LogitsProcessor."""
    import transformers
    import xgrammar
    from xgrammar.contrib.hf import LogitsProcessor

    from engine.structured_output import compile_grammar
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(smollm2_folder)
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(smollm2_folder)
    hf = hf_smollm2()
    eos = hf.config.eos_token_id
    info = xgrammar.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=hf.config.vocab_size, stop_token_ids=[eos])
    compiler = xgrammar.GrammarCompiler(info)
    prompts = chat_prompts(tokenizer)
    cases, expected = [], []
    for index, name in enumerate(ORACLE_SCHEMAS):
        compiled = compile_grammar(compiler, StructuredOutputParams(json_schema=SCHEMAS[name]))
        for prompt in (prompts[index % len(prompts)], prompts[(index + 1) % len(prompts)]):
            ids = torch.tensor([prompt])
            with torch.no_grad():
                generated = hf.generate(
                    ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=40,
                    eos_token_id=eos, pad_token_id=eos, logits_processor=[LogitsProcessor(compiled)],
                )
            cases.append((name, prompt))
            expected.append(generated[0, len(prompt):].tolist())
    return cases, expected


@pytest_slow
@pytest.mark.parametrize("setup", list(ORACLE_SETUPS))
def test_constrained_greedy_matches_hf_with_xgrammar(smollm2_folder, oracle_case, setup):
    cases, expected = oracle_case
    llm = LLM(model=str(smollm2_folder), dtype="float32", device="cpu", **ORACLE_SETUPS[setup])
    params = [constrained(SCHEMAS[name], max_tokens=40) for name, _ in cases]
    outputs = llm.generate([prompt for _, prompt in cases], params, use_tqdm=False)
    eos = llm.engine.eos_token_ids
    # HF keeps the eos it stopped on; the engine's token ids keep it too
    assert [o.outputs[0].token_ids for o in outputs] == expected
    for (name, _), output in zip(cases, outputs):
        if output.outputs[0].token_ids[-1] in eos:
            assert output.outputs[0].finish_reason == "stop"
            assert_valid(output.outputs[0].text, SCHEMAS[name])
    check_setup_exercised(llm, setup)
    assert llm.engine.grammar_compilations == len(ORACLE_SCHEMAS)


@pytest_slow
def test_parallel_greedy_constrained_samples_match_hf(smollm2_folder, oracle_case):
    cases, expected = oracle_case
    llm = LLM(model=str(smollm2_folder), dtype="float32", device="cpu")
    params = [constrained(SCHEMAS[name], max_tokens=40, n=3) for name, _ in cases[:4]]
    outputs = llm.generate([prompt for _, prompt in cases[:4]], params, use_tqdm=False)
    assert [[c.token_ids for c in o.outputs] for o in outputs] == [[tokens] * 3 for tokens in expected[:4]]
