"""The greedy oracle the GGUF and quantized-checkpoint tests share: fixed prompts and Hugging Face's `generate`, one
prompt at a time. Free of gguf-py, so the `cuda` tests that use it collect on a machine without it (a lent GPU)."""

import random
from pathlib import Path

import pytest
import torch

from engine import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
PROMPTS = [[random.Random(length).randrange(2, 300) for _ in range(length)] for length in (5, 40, 90)]


def _hf_generate(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    expected = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, pad_token_id=1, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    return expected


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
