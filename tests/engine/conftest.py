"""The engine tests' shared oracle case: the real SmolLM2's greedy answers from Hugging Face, computed once per session
(reading the GGUF into transformers and 16 one-prompt `generate` calls take about 40 s on 2 cores), for every module
that checks the engine against them (test_hf_equivalence, test_tensor_parallel). Defined here, not imported into the
modules: a session fixture imported into two modules is two fixtures, computed twice."""

from __future__ import annotations

import pytest

from tests.conftest import hf_smollm2
from tests.engine.hf_oracle import SMOLLM2_MAX_TOKENS, SMOLLM2_QUESTIONS, hf_greedy


@pytest.fixture(scope="session")
def smollm2_case(smollm2_folder) -> tuple[str, list[list[int]], list[list[int]]]:
    """(the converted folder, the chat prompts' token ids, HF's greedy tokens for each, stopping at EOS)."""
    from engine.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_folder(smollm2_folder)
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in SMOLLM2_QUESTIONS
    ]
    expected = hf_greedy(hf_smollm2(), prompts, SMOLLM2_MAX_TOKENS, tokenizer.eos_token_id)
    return str(smollm2_folder), prompts, expected
