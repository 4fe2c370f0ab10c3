"""xgrammar vs llguidance vs outlines-core on this CPU, with SmolLM2's tokenizer: what the choice of the
engine's grammar library rests on.

    python -m bench.grammar_libraries

For each library: tokenizer set-up time, compile time of a mid-size extraction schema (nested objects,
arrays, enums, a pattern, anyOf, $ref), and the time to fill one step's token mask for a batch of 64
matchers part-way through a document (the cost the engine pays every decode step). One run, side by side.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import torch

from bench.common import markdown_table

EXTRACTION_SCHEMA: dict = {
    "$defs": {
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "postcode": {"type": "string", "pattern": "^[0-9]{5}$"},
                "country": {"type": "string", "enum": ["FR", "DE", "ES", "IT", "UK"]},
            },
            "required": ["street", "city", "postcode", "country"],
            "additionalProperties": False,
        }
    },
    "type": "object",
    "properties": {
        "invoice_number": {"type": "string"},
        "issued": {"type": "string"},
        "seller": {"$ref": "#/$defs/address"},
        "buyer": {"anyOf": [{"$ref": "#/$defs/address"}, {"type": "null"}]},
        "lines": {
            "type": "array",
            "minItems": 1,
            "maxItems": 20,
            "items": {
                "type": "object",
                "properties": {
                    "description": {"type": "string"},
                    "quantity": {"type": "integer", "minimum": 1},
                    "unit_price": {"type": "number", "minimum": 0},
                },
                "required": ["description", "quantity", "unit_price"],
                "additionalProperties": False,
            },
        },
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP"]},
        "paid": {"type": "boolean"},
    },
    "required": ["invoice_number", "issued", "seller", "lines", "currency", "paid"],
    "additionalProperties": False,
}
# A valid document the matchers are advanced through before the masks are timed.
DOCUMENT = (
    '{"invoice_number": "F-2024-0042", "issued": "2024-03-01", "seller": {"street": "1 rue de la Paix", '
    '"city": "Paris", "postcode": "75002", "country": "FR"}, "buyer": null, "lines": [{"description": "Widget"'
)
BATCH = 64


def _timed(action: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    result = action()
    return time.perf_counter() - started, result


def _mask_seconds(fill: Callable[[], None], repeats: int = 20) -> float:
    fill()  # the first call may warm caches
    started = time.perf_counter()
    for _ in range(repeats):
        fill()
    return (time.perf_counter() - started) / repeats


def bench_xgrammar(hf_tokenizer, vocab_size: int, prefix: list[int]) -> dict[str, float]:
    import xgrammar as xgr

    setup, info = _timed(lambda: xgr.TokenizerInfo.from_huggingface(hf_tokenizer, vocab_size=vocab_size))
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    compile_s, compiled = _timed(lambda: compiler.compile_json_schema(json.dumps(EXTRACTION_SCHEMA)))
    matchers = [xgr.GrammarMatcher(compiled) for _ in range(BATCH)]
    for matcher in matchers:
        for token in prefix:
            assert matcher.accept_token(token)
    bitmask = xgr.allocate_token_bitmask(BATCH, vocab_size)
    batch_matcher = xgr.BatchGrammarMatcher(max_threads=1)
    mask_s = _mask_seconds(lambda: batch_matcher.batch_fill_next_token_bitmask(matchers, bitmask))
    return {"setup_s": setup, "compile_s": compile_s, "mask_batch_ms": mask_s * 1e3}


def bench_llguidance(hf_tokenizer, vocab_size: int, prefix: list[int]) -> dict[str, float]:
    import llguidance
    import llguidance.hf
    import llguidance.torch

    setup, tokenizer = _timed(lambda: llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size))
    grammar = llguidance.LLMatcher.grammar_from_json_schema(EXTRACTION_SCHEMA)
    # llguidance compiles lazily: building the first matcher is the compile step.
    compile_s, first = _timed(lambda: llguidance.LLMatcher(tokenizer, grammar))
    assert not first.is_error(), first.get_error()
    matchers = [first] + [llguidance.LLMatcher(tokenizer, grammar) for _ in range(BATCH - 1)]
    for matcher in matchers:
        assert matcher.consume_tokens(prefix), matcher.get_error()
    bitmask = llguidance.torch.allocate_token_bitmask(BATCH, vocab_size)
    executor = llguidance.LLExecutor(num_threads=1)
    rows = [(matcher, index) for index, matcher in enumerate(matchers)]
    mask_s = _mask_seconds(lambda: llguidance.torch.fill_next_token_bitmask_par(executor, rows, bitmask))
    return {"setup_s": setup, "compile_s": compile_s, "mask_batch_ms": mask_s * 1e3}


def bench_outlines_core(hf_tokenizer, vocab_size: int, prefix: list[int]) -> dict[str, float]:
    from outlines_core import Guide, Index, Vocabulary
    from outlines_core.json_schema import build_regex_from_schema

    def vocabulary() -> Vocabulary:
        byte_of = {char: byte for byte, char in _bytes_to_unicode().items()}
        tokens: dict[bytes, list[int]] = {}
        for token, token_id in hf_tokenizer.get_vocab().items():
            if token_id in hf_tokenizer.all_special_ids:
                continue
            tokens.setdefault(bytes(byte_of[c] for c in token), []).append(token_id)
        return Vocabulary(hf_tokenizer.eos_token_id, tokens)

    setup, vocab = _timed(vocabulary)
    regex = build_regex_from_schema(json.dumps(EXTRACTION_SCHEMA))
    compile_s, index = _timed(lambda: Index(regex, vocab))
    guides = [Guide(index) for _ in range(BATCH)]
    for guide in guides:
        for token in prefix:
            guide.advance(token)
    words = (vocab_size + 31) // 32
    bitmask = torch.zeros((BATCH, words), dtype=torch.int32)

    def fill() -> None:
        for row, guide in enumerate(guides):
            guide.write_mask_into(bitmask[row].data_ptr(), words, 4)

    return {"setup_s": setup, "compile_s": compile_s, "mask_batch_ms": _mask_seconds(fill) * 1e3}


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> the printable character its vocabulary spells it with."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars)}


def main() -> None:
    argparse.ArgumentParser(description=__doc__).parse_args()
    import transformers

    from engine.model_registry import DEFAULT_MODEL, resolve_model

    folder = resolve_model(DEFAULT_MODEL).path
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    vocab_size = json.loads((folder / "config.json").read_text())["vocab_size"]
    # The prefix must be a tokenization every library accepts: xgrammar and llguidance accept any
    # tokenization; outlines' regex index walks the same bytes.
    prefix = hf_tokenizer.encode(DOCUMENT, add_special_tokens=False)
    print(f"CPU: {_cpu_model()}; one thread per library; SmolLM2 vocabulary {vocab_size}")
    print(f"schema: {len(json.dumps(EXTRACTION_SCHEMA))} bytes; mask for {BATCH} matchers after {len(prefix)} tokens")
    rows = []
    for name, run in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance), ("outlines-core", bench_outlines_core)):
        try:
            result = run(hf_tokenizer, vocab_size, prefix)
        except Exception as error:  # one library failing must not hide the others' figures
            rows.append([name, f"failed: {type(error).__name__}: {error}", "", ""])
            continue
        rows.append([name, f"{result['setup_s']:.2f}", f"{result['compile_s']:.3f}", f"{result['mask_batch_ms']:.2f}"])
    print(markdown_table(["library", "tokenizer set-up s", "schema compile s", f"mask, {BATCH} rows, ms"], rows))


def _cpu_model() -> str:
    for line in open("/proc/cpuinfo", encoding="utf-8"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
