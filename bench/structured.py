"""Structured output at batch scale: `--num-requests` extraction requests sharing one JSON schema, constrained vs
the same requests unconstrained with the same output lengths, and constrained with jump-ahead on.

Workload: seeded invoice-like documents ("Invoice 17 from Halden Instruments, Lisbon: 1,234.50 EUR …"), each
in the model's chat template with an instruction to extract the fields; greedy. Three runs, each on a fresh engine:

1. constrained: `response_format`'s JSON schema (nested object, enum, pattern, array, bounds), jump-ahead off;
2. unconstrained: the same prompts, each with `max_tokens` = its constrained output's length and `ignore_eos`,
   so both runs compute exactly the same number of tokens and only the grammar's cost differs
   (with `--repeats N`, N such pairs, alternating which side runs first; the ratio is their median);
3. constrained with jump-ahead on: forced text (keys, punctuation) is appended without a forward pass each.

It prints tokens/s and requests/s, the constrained / unconstrained ratio (target >= 0.9x), the grammar
compilations during the constrained run (target 1: one schema, compiled once) and jump-ahead's steps and tokens.
The one-off start-up of the grammar library (importing xgrammar, reading the vocabulary) is warmed up first.

    python -m bench.structured --num-requests 256
"""

from __future__ import annotations

import argparse
import random
import statistics

from bench.common import Run, Submission, add_model_arguments, describe, drive, load, markdown_table, ratio, run_cli, setup_torch
from engine import LLM, SamplingParams
from engine.structured_output import StructuredOutputParams

TARGET_RATIO = 0.9
INVOICE_SCHEMA = {
    "type": "object",
    "properties": {
        "invoice_number": {"type": "integer", "minimum": 1},
        "seller": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 20}},
            "required": ["name", "city"],
            "additionalProperties": False,
        },
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "total": {"type": "number", "minimum": 0},
        "currency": {"type": "string", "enum": ["EUR", "USD", "GBP", "JPY"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "string", "maxLength": 30}},
        "paid": {"type": "boolean"},
    },
    "required": ["invoice_number", "seller", "date", "total", "currency", "items", "paid"],
    "additionalProperties": False,
}
_SELLERS = ("Halden Instruments", "Acme Ltd", "Globex", "Initech", "Umbrella Foods", "Stark Tools", "Wayne Freight")
_CITIES = ("Lisbon", "Osaka", "Toronto", "Nairobi", "Oslo", "Lima", "Perth", "Seville")
_ITEMS = ("spectrometer", "gimbal", "thermal camera", "flow meter", "laser level", "hygrometer", "service plan")


def document(index: int, rng: random.Random) -> str:
    items = rng.sample(_ITEMS, rng.randint(1, 3))
    return (
        f"Invoice {index + 1} from {rng.choice(_SELLERS)}, {rng.choice(_CITIES)}, dated 2024-{rng.randint(1, 12):02d}-"
        f"{rng.randint(1, 28):02d}: {', '.join(items)}; total {rng.randint(10, 9000)}.{rng.randint(0, 99):02d} "
        f"{rng.choice(('EUR', 'USD', 'GBP', 'JPY'))}, {'paid' if rng.random() < 0.5 else 'payment outstanding'}."
    )


def build_prompts(llm: LLM, count: int) -> list[list[int]]:
    rng = random.Random(0)
    tokenizer = llm.tokenizer
    prompts = []
    for index in range(count):
        messages = [
            {"role": "system", "content": "Extract the invoice's fields as JSON."},
            {"role": "user", "content": document(index, rng)},
        ]
        prompts.append(tokenizer.encode(tokenizer.apply_chat_template(messages), add_special_tokens=False))
    return prompts


def constrained_run(name: str, llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[Run, int]:
    """The run, and the grammar compilations it caused."""
    # Warm the grammar library up (import, vocabulary) with another constraint, outside the measurement.
    llm.generate([prompts[0]], SamplingParams(max_tokens=2, structured_output=StructuredOutputParams(json_object=True)), use_tqdm=False)
    before = llm.engine.grammar_compilations
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, structured_output=StructuredOutputParams(json_schema=INVOICE_SCHEMA)
    )
    run = drive(name, llm, [Submission(str(i), p, params) for i, p in enumerate(prompts)])
    return run, llm.engine.grammar_compilations - before


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_arguments(parser)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=160, help="cap on each constrained output")
    parser.add_argument("--kv-cache-gib", type=float, default=2.0, help="KV cache size (GiB)")
    parser.add_argument(
        "--repeats", type=int, default=1, help="constrained/unconstrained rounds, alternating which runs first"
    )


def unconstrained_run(name: str, llm: LLM, prompts: list[list[int]], lengths: list[int]) -> Run:
    """The same prompts without a constraint, each computing exactly its constrained output's length."""
    return drive(
        name,
        llm,
        [
            Submission(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
            for i, (p, n) in enumerate(zip(prompts, lengths))
        ],
    )


def run(args: argparse.Namespace) -> None:
    setup_torch(args)
    kv_bytes = int(args.kv_cache_gib * 1024**3)

    # Every measured run gets an engine of its own, so none finds another's prompts in the prefix cache.
    llm = load(args, kv_cache_memory=kv_bytes)
    prompts = build_prompts(llm, args.num_requests)
    print(describe(args, llm, requests=len(prompts), prompt=f"{min(map(len, prompts))}-{max(map(len, prompts))}"), flush=True)
    constrained, compilations = constrained_run("constrained", llm, prompts, args.max_tokens)
    del llm
    lengths = [len(constrained.token_ids(str(i))[0]) for i in range(len(prompts))]
    stopped = sum(o.outputs[0].finish_reason == "stop" for o in constrained.outputs.values())
    unconstrained = unconstrained_run("unconstrained", load(args, kv_cache_memory=kv_bytes), prompts, lengths)
    pairs = [(constrained, unconstrained)]
    print(f"round 1: constrained {constrained.seconds:.1f} s, unconstrained {unconstrained.seconds:.1f} s", flush=True)
    # Further rounds alternate which side runs first, so a load that drifts during the command favours neither.
    for round_index in range(1, args.repeats):
        sides = []
        for constrained_side in (False, True) if round_index % 2 else (True, False):
            fresh = load(args, kv_cache_memory=kv_bytes)
            if constrained_side:
                sides.append(constrained_run("constrained", fresh, prompts, args.max_tokens)[0])
            else:
                sides.append(unconstrained_run("unconstrained", fresh, prompts, lengths))
            del fresh
        again = next(r for r in sides if r.name == "constrained")
        plain = next(r for r in sides if r.name == "unconstrained")
        pairs.append((again, plain))
        print(f"round {round_index + 1}: constrained {again.seconds:.1f} s, unconstrained {plain.seconds:.1f} s", flush=True)

    jumping_llm = load(args, kv_cache_memory=kv_bytes, jump_forward=True)
    jumping, jump_compilations = constrained_run("constrained, jump-ahead", jumping_llm, prompts, args.max_tokens)
    jump_tokens = jumping_llm.engine.jump_forward_tokens
    print(f"constrained with jump-ahead: {jumping.seconds:.1f} s, {jumping.output_tokens} tokens, {len(jumping.steps)} steps", flush=True)

    print()
    headers = ["run", "output tokens", "steps", "wall s", "out tok/s", "req/s", "tok/s vs unconstrained",
               "req/s vs unconstrained", "grammar compilations"]
    rows = [
        [r.name, r.output_tokens, len(r.steps), f"{r.seconds:.1f}", f"{r.output_tokens_per_second:.1f}",
         f"{r.requests_per_second:.2f}", ratio(r.output_tokens_per_second, unconstrained.output_tokens_per_second),
         ratio(r.requests_per_second, unconstrained.requests_per_second), compiled]
        for r, compiled in ((unconstrained, 0), (constrained, compilations), (jumping, jump_compilations))
    ]
    print(markdown_table(headers, rows))
    print()
    print(f"constrained outputs that stopped (valid JSON) rather than hit --max-tokens: {stopped}/{len(prompts)}")
    print(f"jump-ahead: {jump_tokens} of {jumping.output_tokens} output tokens appended without their own forward "
          f"pass; {len(jumping.steps)} steps vs {len(constrained.steps)}")
    ratios = sorted(c.output_tokens_per_second / u.output_tokens_per_second for c, u in pairs)
    achieved = statistics.median(ratios)
    print(f"constrained / unconstrained throughput per round: {', '.join(f'{r:.2f}x' for r in ratios)}")
    print(f"median over {len(pairs)} round(s): {achieved:.2f}x (target >= {TARGET_RATIO}x): "
          f"{'met' if achieved >= TARGET_RATIO else 'NOT met'}; compilations: {compilations} (target 1)")


if __name__ == "__main__":
    main()
