"""The greedy oracle the engine tests share: Hugging Face's `generate`, one prompt at a time, with the tiny Llama's
fixed prompts (GGUF and quantized checkpoints) and the real SmolLM2's chat questions; and the teacher-forced
agreement measure of the formats that change the numbers (W8A8, int8 activations). Free of gguf-py, so the `cuda`
tests that use it collect on a machine without it (a lent GPU)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

from engine import SamplingParams

if TYPE_CHECKING:
    from engine import LLM

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[random.Random(length).randrange(2, 300) for _ in range(length)] for length in (5, 40, 90)]


# The real SmolLM2's oracle case (tests/engine/conftest.py's `smollm2_case`): chat questions, greedy, 20 tokens.
SMOLLM2_QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child in two sentences.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Give me a short recipe for pancakes, with quantities for four people and the steps in order.",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Summarise the plot of Romeo and Juliet in one paragraph, mentioning the families and the ending.",
    "Name a mammal that can fly.",
    "Why is the sky blue?",
    "Suggest a name for a pet turtle.",
    "What does a compiler do? Answer briefly.",
    "Describe the water cycle, covering evaporation, condensation, precipitation and collection.",
    "Hi!",
    "What colour do you get when you mix blue and yellow?",
]
SMOLLM2_MAX_TOKENS = 20


def hf_greedy(model, prompts: list[list[int]], max_tokens: int, eos: int | None) -> list[list[int]]:
    """One prompt at a time: no padding, so HF's numbers are its cleanest. `eos` None: every prompt runs
    `max_tokens` tokens."""
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_tokens,
                eos_token_id=eos, pad_token_id=eos if eos is not None else 0,
            )
        outputs.append(generated[0, len(prompt):].tolist())
    return outputs


@pytest.fixture(scope="module")
def tiny_llama_folder(tmp_path_factory) -> Path:
    """A random float32 Llama saved as a Hugging Face folder (with the tokenizer of the GGUF tests' vocabulary
    not needed: prompts are token ids)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=300, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
        eos_token_id=1,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "norm" not in name:
                parameter.normal_(0.0, 0.15)
    folder = tmp_path_factory.mktemp("tiny-llama")
    model.float().save_pretrained(folder)
    return folder


@dataclass(frozen=True)
class Agreement:
    """How close a run that changes the numbers stays to its reference, teacher-forced (`teacher_forced_agreement`)."""

    positions: int
    agreeing: int  # positions whose top token is the reference's
    mean_logprob_difference: float  # |log-prob difference| of the fed tokens, nats
    max_logprob_difference: float

    @property
    def fraction(self) -> float:
        return self.agreeing / self.positions


def teacher_forced_agreement(reference: LLM, candidate: LLM, prompts: list[list[int]]) -> Agreement:
    """The reference's greedy continuations (GREEDY) of `prompts`, fed to both engines as prompts and scored by
    their prompt log-probs (one prefill each), so that one differing token does not change every later position:
    at how many positions the two rank the same top token, and how far apart the log-probs they give the fed tokens
    are."""
    forced = [prompt + output.outputs[0].token_ids
              for prompt, output in zip(prompts, reference.generate(prompts, GREEDY, use_tqdm=False))]
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    agreeing = 0
    differences = []
    for theirs, ours in zip(reference.generate(forced, scoring, use_tqdm=False),
                            candidate.generate(forced, scoring, use_tqdm=False)):
        for expected, got in zip(theirs.prompt_logprobs, ours.prompt_logprobs):
            if expected is None:  # the first token has no log-prob
                continue
            agreeing += max(expected, key=expected.get) == max(got, key=got.get)
            token = next(iter(expected))  # the fed token comes first, then the top alternative
            differences.append(abs(expected[token] - got[token]))
    return Agreement(len(differences), agreeing, sum(differences) / len(differences), max(differences))
