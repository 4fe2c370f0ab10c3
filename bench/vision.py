"""Images in batch lines: a mixed batch of image and text lines on a small random vision-language model, conveyor
against transformers' `generate` in batches, in one run, on the same lines; then the encoder-output cache on chunked
prompts.

`--family qwen2_5_vl` (the default, the issue's "tiny-shape Qwen2.5-VL-like model"): Qwen2.5-VL's architecture
(windowed ViT at dynamic resolution, 2 x 2 patch merger, Qwen2 decoder with M-RoPE) scaled down; `--shape small`:
images resized to at most 224 x 224 px, up to 64 placeholder tokens each, 4 + 4 layers; `--shape tiny`: the tests'
model, at most 112 x 140 px, up to 20 placeholders. `--family llava`: LLaVA-1.5's architecture (CLIP tower,
projector, Llama); `small`: 112 px images, 64 placeholders, 4 + 4 layers; `tiny`: the tests' model, 16
placeholders. `--family gemma3`: Gemma 3's (SigLIP tower, pooled projector, Gemma 3 decoder with sliding-window and
global layers alternating, an image's placeholders attending to each other both ways); `small`: 224 px images,
16 x 16 patches pooled to 64 placeholders, 4 + 4 layers, a 32-token window; `tiny`: the tests' model, 16
placeholders. Each is built and saved by transformers at run time with seeded random weights
(bench/vision_models.py). Every line is a user turn of random words from the tokenizer's vocabulary; every
`--image-every`-th line carries one image of random size (PIL noise, 20-200 px a side), all different. Decoding is
greedy for exactly `--max-tokens` tokens on both sides (min_tokens / min_new_tokens).

  - conveyor: `LLM.chat` over the whole batch (continuous batching, the vision encoder run inside the steps).
  - HF: `generate` on `--hf-batch-size` lines at a time, the folder's processor building the padded batch
    (left padding) with its images; preprocessing counts in its time as it does in conveyor's.

Each of `--repeats` rounds runs both sides on a fresh batch (new seed, so the encoder cache carries nothing over;
the prefix cache is off in these runs); the table gives each side's median images/s (images in the batch over the
batch's wall time) and output tok/s, and the median ratio of the rounds. "Identical to HF" counts the lines whose tokens
equal HF's (float32 should give all; bfloat16 and HF's padding may not). The second table runs one batch again
with prefill chunks of `--chunk-tokens` tokens, so most images span several steps, with the encoder cache on and
off: `stats()`'s images_encoded and encoder_cache_hits (hit rate = hits / (hits + encodes)). Gemma 3 computes an
image's placeholders in one step (they attend to each other both ways), so its chunks default to one image's
placeholders: the text around an image is chunked, the image never is, and each image is encoded once either way.

    python -m bench.vision                                  # Qwen2.5-VL-like, small shape, float32, CPU
    python -m bench.vision --family llava --shape tiny --lines 4 --max-tokens 4 --repeats 1 --chunk-tokens 5
    python -m bench.vision --family gemma3 --lines 8 --repeats 3

`--device cuda` puts both sides on a GPU (not yet run on one). There is no real-shape option yet (Qwen2.5-VL-7B with
dummy weights: a config-and-processor folder loaded with `load_format="dummy"` by conveyor, transformers' model
built in GPU memory), as nothing in this project's sessions could run and check it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from bench import vision_models
from bench.common import markdown_table, run_cli
from bench.vision_models import image
from engine import LLM, SamplingParams


@dataclass(frozen=True)
class Family:
    """A vision-language family as the benchmark builds and runs it."""

    label: str
    shapes: dict[str, Any]  # --shape -> the builder's shape
    make: Callable[[Path, Any], Path]  # (folder, shape) -> the saved folder
    words: list[str]  # the tokenizer's named words: the random text uses the others ("w<i>")
    hf_class: str  # the transformers model class
    processor: Callable[[Path], Any]  # the folder's transformers processor
    placeholders: Callable[[Any], str]  # image tokens per image, in words
    # The chunked runs' default max_num_batched_tokens: 16, or an image's placeholders where the model computes an
    # image in one step (Gemma 3: they attend to each other both ways), since a smaller step could never hold it
    chunk_tokens: Callable[[Any], int] = lambda shape: 16


def _auto_processor(folder: Path) -> Any:
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder)
    processor.tokenizer.pad_token = processor.tokenizer.pad_token or "<unk>"  # LLaVA's word-level tokenizer has none
    return processor


FAMILIES = {
    "qwen2_5_vl": Family(
        "Qwen2.5-VL-like", {"tiny": vision_models.QWEN_TINY, "small": vision_models.QWEN_SMALL},
        vision_models.make_qwen2_5_vl, vision_models.QWEN_WORDS, "Qwen2_5_VLForConditionalGeneration",
        vision_models.qwen_processor,
        lambda shape: f"up to {shape.max_pixels // (2 * shape.patch) ** 2} image tokens per image, by its size",
    ),
    "llava": Family(
        "LLaVA-1.5", {"tiny": vision_models.TINY, "small": vision_models.SMALL}, vision_models.make_llava,
        vision_models.WORDS, "LlavaForConditionalGeneration", _auto_processor,
        lambda shape: f"{(shape.image_size // shape.patch) ** 2} image tokens per image",
    ),
    "gemma3": Family(
        "Gemma 3", {"tiny": vision_models.GEMMA3_TINY, "small": vision_models.GEMMA3_SMALL}, vision_models.make_gemma3,
        vision_models.GEMMA3_WORDS + vision_models.GEMMA3_NEWLINES, "Gemma3ForConditionalGeneration", _auto_processor,
        lambda shape: f"{shape.image_tokens} image tokens per image", lambda shape: shape.image_tokens,
    ),
}


@dataclass(frozen=True)
class Side:
    seconds: float
    images: int
    tokens: list[list[int]]  # per line

    @property
    def images_per_second(self) -> float:
        return self.images / self.seconds

    @property
    def tokens_per_second(self) -> float:
        return sum(len(t) for t in self.tokens) / self.seconds


def make_batch(args: argparse.Namespace, seed: int) -> list[list[dict[str, Any]]]:
    """`args.lines` one-turn conversations; every `image_every`-th has an image (its own seed, size in 20-200 px)."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(len(FAMILIES[args.family].words), 500)]
    conversations = []
    for line in range(args.lines):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(*args.prompt_words)))
        parts: list[dict[str, Any]] = [{"type": "text", "text": text}]
        if line % args.image_every == 0:
            picture = image(seed * 100_003 + line, rng.randint(20, 200), rng.randint(20, 200))
            parts.insert(0, {"type": "image", "image": picture})
        conversations.append([{"role": "user", "content": parts}])
    return conversations


def images_of(conversation: list[dict[str, Any]]) -> list[Any]:
    return [part["image"] for part in conversation[0]["content"] if part["type"] == "image"]


def greedy(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=args.max_tokens, min_tokens=args.max_tokens)


def run_conveyor(llm: LLM, batch: list[list[dict[str, Any]]], args: argparse.Namespace) -> Side:
    started = time.perf_counter()
    outputs = llm.chat(batch, greedy(args), use_tqdm=False)
    seconds = time.perf_counter() - started
    return Side(seconds, sum(len(images_of(c)) for c in batch), [o.outputs[0].token_ids for o in outputs])


def run_hf(model: Any, processor: Any, batch: list[list[dict[str, Any]]], args: argparse.Namespace) -> Side:
    tokens = []
    started = time.perf_counter()
    for first in range(0, len(batch), args.hf_batch_size):
        part = batch[first : first + args.hf_batch_size]
        texts = [processor.apply_chat_template(c, add_generation_prompt=True) for c in part]
        # One list per line, as Gemma 3's processor needs to place each line's images (the others flatten them)
        per_line = [images_of(c) for c in part]
        images = per_line if any(per_line) else None
        inputs = processor(images=images, text=texts, padding=True, return_tensors="pt").to(args.device)
        with torch.inference_mode():
            output = model.generate(
                **inputs, max_new_tokens=args.max_tokens, min_new_tokens=args.max_tokens, do_sample=False
            )
        tokens.extend(row.tolist() for row in output[:, inputs["input_ids"].shape[1] :])
    seconds = time.perf_counter() - started
    return Side(seconds, sum(len(images_of(c)) for c in batch), tokens)


def load_hf(folder: Path, args: argparse.Namespace) -> tuple[Any, Any]:
    import transformers

    family = FAMILIES[args.family]
    processor = family.processor(folder)
    processor.tokenizer.padding_side = "left"  # generate appends on the right
    model_class = getattr(transformers, family.hf_class)
    model = model_class.from_pretrained(folder, dtype=getattr(torch, args.dtype))
    return model.to(args.device).eval(), processor


def main(argv: list[str] | None = None) -> None:
    run_cli(__doc__, add_arguments, run, argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl")
    parser.add_argument("--shape", choices=("tiny", "small"), default="small")
    parser.add_argument("--dtype", default="float32", help="both sides (float32: the outputs should be identical)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--lines", type=int, default=16)
    parser.add_argument("--image-every", type=int, default=2, help="every n-th line carries an image")
    parser.add_argument("--prompt-words", type=int, nargs=2, default=(8, 32), metavar=("MIN", "MAX"))
    parser.add_argument("--max-tokens", type=int, default=16, help="generated per line, exactly")
    parser.add_argument("--hf-batch-size", type=int, default=8, help="lines per HF generate call")
    parser.add_argument(
        "--chunk-tokens", type=int, default=None,
        help="max_num_batched_tokens of the chunked runs (default 16; gemma3: an image's placeholders, 64 or 16)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds of conveyor then HF")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace) -> None:
    family = FAMILIES[args.family]
    shape = family.shapes[args.shape]
    placeholders = family.placeholders(shape)
    print(
        f"{family.label} shape={args.shape} ({placeholders}) dtype={args.dtype} device={args.device} "
        f"lines={args.lines} (an image every {args.image_every}) prompt-words={args.prompt_words[0]}-"
        f"{args.prompt_words[1]} max-tokens={args.max_tokens} hf-batch-size={args.hf_batch_size} "
        f"repeats={args.repeats} threads={torch.get_num_threads()}",
        flush=True,
    )
    with tempfile.TemporaryDirectory(prefix="bench-vision-") as scratch:
        folder = family.make(Path(scratch) / args.family, shape)
        options = dict(dtype=args.dtype, device=args.device)
        llm = LLM(str(folder), enable_prefix_caching=False, max_num_seqs=args.lines, **options)
        model, processor = load_hf(folder, args)
        warm_args = argparse.Namespace(**{**vars(args), "lines": 2})
        warm = make_batch(warm_args, seed=args.seed + args.repeats)  # a seed no round uses
        run_conveyor(llm, warm, args), run_hf(model, processor, warm, args)  # first-use costs out of the figures
        rounds = []
        for round_index in range(args.repeats):
            batch = make_batch(args, args.seed + round_index)
            rounds.append((run_conveyor(llm, batch, args), run_hf(model, processor, batch, args)))
        ratios = [ours.tokens_per_second / theirs.tokens_per_second for ours, theirs in rounds]
        print(f"conveyor / HF tok/s per round: {', '.join(f'{r:.2f}' for r in ratios)}", flush=True)
        identical = sum(a == b for ours, theirs in rounds for a, b in zip(ours.tokens, theirs.tokens))
        rows = []
        for side, label in ((0, "conveyor"), (1, f"HF generate, batches of {args.hf_batch_size}")):
            rows.append([
                label, f"{statistics.median(r[side].images_per_second for r in rounds):.2f}",
                f"{statistics.median(r[side].tokens_per_second for r in rounds):.1f}",
                f"{statistics.median(ratios) if side == 0 else 1.0:.2f}x",
            ])
        print(markdown_table(["run", "images/s", "output tok/s", "vs HF"], rows))
        print(f"identical to HF: {identical}/{args.lines * args.repeats} lines", flush=True)

        batch = make_batch(args, args.seed)  # round 0's lines, whose HF tokens are known
        chunk_tokens = args.chunk_tokens or family.chunk_tokens(shape)
        rows = []
        for label, cache_tokens in (("encoder cache on", None), ("encoder cache off", 0)):
            extra = {} if cache_tokens is None else {"encoder_cache_tokens": cache_tokens}
            chunked = LLM(str(folder), max_num_batched_tokens=chunk_tokens, max_num_seqs=args.lines, **extra,
                          **options)
            result = run_conveyor(chunked, batch, args)
            stats = chunked.engine.stats()
            lookups = stats.images_encoded + stats.encoder_cache_hits
            same = sum(a == b for a, b in zip(result.tokens, rounds[0][1].tokens))
            rows.append([
                label, result.images, stats.images_encoded, stats.encoder_cache_hits,
                f"{stats.encoder_cache_hits / lookups:.0%}" if lookups else "n/a", f"{same}/{args.lines}",
            ])
        print(f"chunked prefill: max_num_batched_tokens={chunk_tokens}, {placeholders}")
        print(markdown_table(
            ["run", "images", "encoder runs", "encoder cache hits", "hit rate", "identical to HF"], rows
        ))


if __name__ == "__main__":
    main()
