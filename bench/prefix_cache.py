"""Automatic prefix caching on a RAG-like workload: many questions about one long document.

Workload: one deterministic report of about `--doc-tokens` tokens (generated facts: year, team, city,
head count, product), and `--num-questions` different short questions about it. Each prompt is the
model's chat template around "the report, then the question", so all prompts share the system prompt
and the document and differ only in their last few dozen tokens. Greedy, `ignore_eos`, `--max-tokens`
each, all submitted at t=0. Two runs, identical but for prefix caching off / on.

Blocks enter the prefix cache once computed; a prompt whose next block another sequence computes in
the same step waits one step for it, so the document should be computed once. The benchmark prints
how many requests the first step admitted and the prefill tokens next to that ideal.

    python -m bench.prefix_cache --doc-tokens 2000 --num-questions 64 --max-tokens 32
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from bench.common import (
    Run,
    Submission,
    add_model_arguments,
    describe,
    drive,
    load,
    markdown_table,
    ratio,
    run_cli,
    setup_torch,
)
from engine import LLM, SamplingParams
from engine.tokenizer import Tokenizer

TARGET_PREFILL_REDUCTION = 5.0
TARGET_THROUGHPUT_GAIN = 2.0

_TEAMS = ("optics", "firmware", "logistics", "robotics", "acoustics", "materials", "sensors", "telemetry", "power")
_CITIES = ("Lisbon", "Osaka", "Toronto", "Nairobi", "Oslo", "Lima", "Perth", "Seville", "Tallinn", "Quito", "Busan")
_PRODUCTS = ("spectrometer", "gimbal", "thermal camera", "flow meter", "laser level", "seismograph", "hygrometer")


@dataclass(frozen=True)
class Fact:
    year: int
    team: str
    city: str
    engineers: int
    product: str

    @classmethod
    def number(cls, i: int) -> "Fact":
        return cls(
            year=1950 + i,
            team=_TEAMS[i % len(_TEAMS)],
            city=_CITIES[(3 * i) % len(_CITIES)],
            engineers=10 + (37 * i) % 90,
            product=f"{_PRODUCTS[(5 * i) % len(_PRODUCTS)]} model {chr(65 + i % 26)}-{100 + 7 * i}",
        )

    def sentence(self) -> str:
        return (
            f"In {self.year}, the {self.team} team of Halden Instruments opened an office in {self.city}, "
            f"hired {self.engineers} engineers and shipped the {self.product}."
        )

    def question(self, kind: int) -> str:
        return (
            f"Which city did the {self.team} team open an office in in {self.year}?",
            f"How many engineers did the {self.team} team hire in {self.year}?",
            f"Which product did the {self.team} team ship in {self.year}?",
        )[kind]


def build_document(tokenizer: Tokenizer, doc_tokens: int) -> tuple[str, list[Fact]]:
    """Sentences of consecutive facts until the text reaches `doc_tokens` tokens."""
    facts: list[Fact] = []
    text = ""
    while len(tokenizer.encode(text, add_special_tokens=False)) < doc_tokens:
        facts.append(Fact.number(len(facts)))
        text = " ".join(f.sentence() for f in facts)
    return text, facts


def build_questions(facts: list[Fact], num_questions: int) -> list[str]:
    """One question per fact, then a second kind of question per fact, and so on: all different."""
    kinds = 3
    if num_questions > kinds * len(facts):
        raise SystemExit(f"the document supports at most {kinds * len(facts)} different questions")
    return [facts[i % len(facts)].question(i // len(facts)) for i in range(num_questions)]


def build_prompts(tokenizer: Tokenizer, document: str, questions: list[str]) -> list[list[int]]:
    def prompt(question: str) -> list[int]:
        content = f"Read the report, then answer the question.\n\nReport:\n{document}\n\nQuestion: {question}"
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}])
        return tokenizer.encode(text, add_special_tokens=False)

    return [prompt(q) for q in questions]


def ideal_prefill_tokens(prompts: list[list[int]], block_size: int) -> int:
    """Prompt tokens computed if the prefix common to all prompts were computed once, by the first
    request, and every later one found its full blocks cached (the last token is always computed).
    Questions that share more than that (the same opening words) can do better."""
    shared = min(_common_prefix(prompts[0], p) for p in prompts)
    total = len(prompts[0])
    for p in prompts[1:]:
        cached_blocks = min(shared // block_size, (len(p) - 1) // block_size)
        total += len(p) - cached_blocks * block_size
    return total


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def format_table(runs: list[Run], baseline: Run) -> str:
    headers = [
        "prefix caching", "prefill tok computed", "hit rate", "wall s", "req/s", "out tok/s",
        "prefill reduction vs off", "req/s vs off",
    ]
    rows = [
        [
            r.name, r.prompt_tokens_computed, f"{r.prefix_cache_hit_rate:.1%}", f"{r.seconds:.1f}",
            f"{r.requests_per_second:.2f}", f"{r.output_tokens_per_second:.1f}",
            ratio(baseline.prompt_tokens_computed, r.prompt_tokens_computed),
            ratio(r.requests_per_second, baseline.requests_per_second),
        ]
        for r in runs
    ]
    return markdown_table(headers, rows)


def verdict(name: str, achieved: float, target: float) -> str:
    return f"{name}: {achieved:.2f}x (target >= {target:g}x): {'met' if achieved >= target else 'NOT met'}"


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--doc-tokens", type=int, default=2000, help="length of the shared document")
    parser.add_argument("--num-questions", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32, help="output tokens per question")


def run(args: argparse.Namespace) -> None:
    setup_torch(args)
    runs: list[Run] = []
    prompts: list[list[int]] = []
    first_step_admitted = 0
    for caching in (False, True):
        llm = load(args, enable_prefix_caching=caching)
        if not prompts:
            prompts = _prepare(args, llm)
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        submissions = [Submission(str(i), p, params) for i, p in enumerate(prompts)]
        runs.append(drive("on" if caching else "off", llm, submissions))
        print(f"prefix caching {runs[-1].name}: {runs[-1].seconds:.1f} s", flush=True)
        if caching:
            first_step_admitted = runs[-1].steps[0].sequences
        del llm
    off, on = runs
    print()
    print(format_table(runs, baseline=off))
    print()
    ideal = ideal_prefill_tokens(prompts, block_size=args.block_size)
    print(
        f"first step admitted {first_step_admitted} request(s); prefill tokens with caching: "
        f"{on.prompt_tokens_computed}; if only the prefix common to all prompts were reused: {ideal} "
        f"({off.prompt_tokens_computed / ideal:.1f}x fewer than off)"
    )
    print(verdict("prefill tokens, off / on", off.prompt_tokens_computed / on.prompt_tokens_computed,
                  TARGET_PREFILL_REDUCTION))
    print(verdict("throughput (req/s), on / off", on.requests_per_second / off.requests_per_second,
                  TARGET_THROUGHPUT_GAIN))


def _prepare(args: argparse.Namespace, llm: LLM) -> list[list[int]]:
    """Build the prompts with the loaded model's tokenizer and print the workload line."""
    document, facts = build_document(llm.tokenizer, args.doc_tokens)
    prompts = build_prompts(llm.tokenizer, document, build_questions(facts, args.num_questions))
    doc_len = len(llm.tokenizer.encode(document, add_special_tokens=False))
    print(
        describe(
            args, llm, document_tokens=doc_len, questions=len(prompts),
            prompt=f"{min(map(len, prompts))}-{max(map(len, prompts))}", max_tokens=args.max_tokens,
        ),
        flush=True,
    )
    return prompts


if __name__ == "__main__":
    main()
