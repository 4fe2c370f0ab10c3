"""PEFT LoRA adapters on SmolLM2 made in a test (random, B non-zero so each adapter changes the output), shared by the
`conveyor run` and service tests."""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from tests.conftest import hf_smollm2


def save_smollm2_adapters(folder: Path, names: list[str], target_modules: list[str]) -> dict[str, Path]:
    """One rank-4 adapter per name (seeded by its index) under `folder`/name; returns name -> its folder."""
    import peft

    folders = {}
    for seed, name in enumerate(names):
        torch.manual_seed(seed)
        # init_lora_weights=False: B non-zero, so the adapter changes the output
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=target_modules, init_lora_weights=False)
        # a copy: peft wraps the model it is given in place, and hf_smollm2's is shared
        peft.get_peft_model(copy.deepcopy(hf_smollm2()), config).save_pretrained(folder / name)
        folders[name] = folder / name
    return folders
