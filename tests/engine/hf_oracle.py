"""The greedy oracle the engine tests share: Hugging Face's `generate`, one prompt at a time, with the tiny Llama's
fixed prompts (GGUF and quantized checkpoints) and the real SmolLM2's chat questions. Free of gguf-py, so the `cuda`
tests that use it collect on a machine without it (a lent GPU)."""

import random
from pathlib import Path

import pytest
import torch

from engine import SamplingParams

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
