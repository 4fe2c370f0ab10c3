"""Structured output: constrained decoding with xgrammar.

A request's `StructuredOutputParams` (plain data: a JSON schema, any JSON object, a regex, a choice of
strings, an EBNF grammar or an xgrammar structural tag) is compiled once per engine into an xgrammar `CompiledGrammar` against the
model's tokenizer; compiled grammars are cached by the constraint's key, so a job whose lines share one
schema compiles it once. Compilation runs on a small thread pool, off the step loop: the engine keeps a
constrained request out of the scheduler until its grammar is ready, while everything else keeps stepping.

Each constrained sequence owns a `GrammarMatcher` (its parse state). Every step the engine fills one
token bitmask for the whole batch from the matchers of the rows that sample (`fill_token_bitmask`, on a thread
of its own while the model runs), the sampler applies it to the logits in one kernel, and the engine advances each
matcher with its sampled token. Parallel samples fork their parent's matcher; preempted sequences keep theirs (their generated
tokens were accepted when they were sampled and are only recomputed as KV, never re-accepted).

Why xgrammar (see `python -m bench.grammar_libraries` and README): vLLM's default; the fastest schema
compile and per-step mask of the three libraries on this CPU but llguidance's compile (both far ahead of
outlines-core, whose regex index took a second for a mid-size schema); `fork`, `rollback` and
`find_jump_forward_string` (jump-ahead) on the matcher; a CPU and a CUDA kernel for applying the
bitmask; and `xgrammar.contrib.hf.LogitsProcessor`, which makes Hugging Face `generate` with the same
grammar the correctness oracle.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the API imports the params without torch; xgrammar imports transformers (seconds)
    import torch
    import xgrammar

    from engine.tokenizer import Tokenizer

# xgrammar's JSON grammar between tokens: compact, one space after "," and ":" (json.dumps' default). Free
# whitespace lets small models loop on newlines until max_tokens; a fixed layout also makes keys and
# punctuation a single continuation, which jump-ahead skips.
JSON_SEPARATORS = (", ", ": ")


@dataclass(frozen=True)
class StructuredOutputParams:
    """Exactly one constraint on a request's output.

    json_schema: a JSON Schema (dict or its JSON text); json_object: any JSON object; regex: a regular
    expression the whole output matches; choice: the output is exactly one of these strings; grammar: an
    EBNF grammar in xgrammar's (GBNF-style) dialect with a `root` rule; structural_tag: xgrammar's structural
    tag (JSON: tagged segments such as tool calls, each with a JSON schema, among free text or alone).
    """

    json_schema: dict[str, Any] | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    structural_tag: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        if isinstance(self.json_schema, str):
            try:
                object.__setattr__(self, "json_schema", json.loads(self.json_schema))
            except json.JSONDecodeError as error:
                raise ValueError(f"json_schema is not valid JSON: {error}") from None
        given = [name for name, value in self._constraints().items() if value not in (None, False)]
        if len(given) != 1:
            raise ValueError(f"structured output takes exactly one of {sorted(self._constraints())}, got {given}")
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise ValueError("json_schema must be a JSON object (or true/false)")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string")

    def _constraints(self) -> dict[str, object]:
        return {
            "json_schema": self.json_schema,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": self.choice,
            "grammar": self.grammar,
            "structural_tag": self.structural_tag,
        }

    @property
    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal keys compile to the same grammar. Key order is kept, since the
        grammar emits an object's properties in the schema's order."""
        kind, value = next((k, v) for k, v in self._constraints().items() if v not in (None, False))
        text = value if isinstance(value, str) else json.dumps(value, separators=(",", ":"), ensure_ascii=False)
        return kind, text


def compile_grammar(compiler: "xgrammar.GrammarCompiler", params: StructuredOutputParams) -> "xgrammar.CompiledGrammar":
    """The constraint compiled against the compiler's tokenizer. Raises ValueError for a constraint
    xgrammar cannot turn into a grammar (the message says why)."""
    import xgrammar

    try:
        if params.json_schema is not None:
            return compiler.compile_json_schema(
                json.dumps(params.json_schema), any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=True
            )
        if params.json_object:
            return compiler.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS, strict_mode=False
            )
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.choice is not None:
            alternatives = " | ".join(json.dumps(choice) for choice in params.choice)
            return compiler.compile_grammar(f"root ::= {alternatives}")
        if params.structural_tag is not None:
            return compiler.compile_structural_tag(json.dumps(params.structural_tag))
        assert params.grammar is not None
        return compiler.compile_grammar(params.grammar)
    except (RuntimeError, ValueError, TypeError, xgrammar.exception.InvalidJSONError) as error:
        raise ValueError(f"cannot compile the {params.key[0]} constraint: {error}") from None


def tokenizer_info(tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: Sequence[int]) -> "xgrammar.TokenizerInfo":
    """xgrammar's view of the vocabulary, sized to the model's logits (which may be padded past the
    tokenizer's vocabulary). Built through transformers' fast-tokenizer wrapper over the same `tokenizers`
    object, as xgrammar's own Hugging Face path does, so the oracle and the engine see one vocabulary."""
    import transformers
    import xgrammar

    wrapper = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer.backend)
    return xgrammar.TokenizerInfo.from_huggingface(wrapper, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids))


class GrammarCompilerPool:
    """Compiles constraints on `threads` background threads, each at most once while it stays among the
    `cache_size` most recently used. `compilations` counts the compiles started (cache misses)."""

    def __init__(
        self, tokenizer: "Tokenizer", vocab_size: int, stop_token_ids: Sequence[int], threads: int, cache_size: int
    ) -> None:
        import xgrammar

        self.vocab_size = vocab_size
        self.stop_token_ids = tuple(stop_token_ids)
        # xgrammar's own cache is off: ours bounds memory by entry count and counts misses.
        self._compiler = xgrammar.GrammarCompiler(
            tokenizer_info(tokenizer, vocab_size, stop_token_ids), max_threads=1, cache_enabled=False
        )
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar-compile")
        self._bitmask_filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-bitmask")
        self._cache: OrderedDict[tuple[str, str], Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # compile threads never touch the cache; the lock guards callers only
        self.compilations = 0

    def compiled(self, params: StructuredOutputParams) -> "Future[xgrammar.CompiledGrammar]":
        key = params.key
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                return future
            future = self._executor.submit(compile_grammar, self._compiler, params)
            self.compilations += 1
            self._cache[key] = future
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)  # a running compile still completes for its waiters
            return future

    def matcher(self, compiled: "xgrammar.CompiledGrammar", extra_stop_token_ids: Sequence[int]) -> "xgrammar.GrammarMatcher":
        """A fresh parse state. The grammar may end on the model's eos or on the request's own stop ids."""
        import xgrammar

        stops = list(dict.fromkeys([*self.stop_token_ids, *extra_stop_token_ids]))
        return xgrammar.GrammarMatcher(compiled, override_stop_tokens=stops)

    def fill_bitmask(self, matchers: Sequence["xgrammar.GrammarMatcher | None"]) -> "Future[torch.Tensor | None]":
        """The step's bitmask (`fill_token_bitmask`), filled on a thread of its own so that it overlaps the step's
        forward pass: xgrammar releases the GIL while it fills (256 rows of a JSON schema: 13 ms on one AMD EPYC
        core, hidden behind a step of several hundred). The matchers must not change until it is done."""
        return self._bitmask_filler.submit(fill_token_bitmask, matchers, self.vocab_size)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
        self._bitmask_filler.shutdown(wait=True)


def fill_token_bitmask(matchers: Sequence["xgrammar.GrammarMatcher | None"], vocab_size: int) -> "torch.Tensor | None":
    """One int32 bitmask [rows, ceil(vocab / 32)] for the step: row i allows what matchers[i] allows;
    rows without a matcher allow everything. None when no row is constrained. A matcher listed on
    several rows (a prompt's first token sampled for n samples) is asked once and its row copied."""
    import xgrammar

    if all(matcher is None for matcher in matchers):
        return None
    bitmask = xgrammar.allocate_token_bitmask(len(matchers), vocab_size)  # all ones: allow everything
    first_row: dict[int, int] = {}
    for row, matcher in enumerate(matchers):
        if matcher is None:
            continue
        seen = first_row.setdefault(id(matcher), row)
        if seen != row:
            bitmask[row] = bitmask[seen]
        elif not matcher.is_terminated():
            matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


def apply_token_bitmask(logits: "torch.Tensor", bitmask: "torch.Tensor", cpu_kernels: bool = False) -> None:
    """Disallowed tokens' logits become -inf, in place: with `cpu_kernels` (logits on the CPU) by ours, which fills
    whole disallowed words at once (256 rows of SmolLM2's vocabulary with a JSON key's mask, one thread, AMD EPYC:
    1.4 ms against xgrammar's 38 ms); else by xgrammar's kernel for the logits' device.

    xgrammar 0.2.8's CPU kernel also writes -inf for the cleared bits past the vocabulary's end in a row's
    last word, which land in the next row when the vocabulary is not a multiple of 32: those bits are set
    first (allowed), so it writes nothing there (tests/engine/test_structured_output.py checks a 100-token
    vocabulary). It is 5-8x faster than xgrammar's torch version on CPU.
    """
    if cpu_kernels:
        from conveyor_kernels import cpu_kernels as kernels

        kernels.apply_token_bitmask(logits, bitmask)
        return

    import xgrammar

    tail = logits.shape[-1] % 32
    if tail:
        bitmask[:, -1] |= -(1 << tail)  # bits tail..31 of the last word
    xgrammar.apply_token_bitmask_inplace(logits, bitmask.to(logits.device, non_blocking=True))
