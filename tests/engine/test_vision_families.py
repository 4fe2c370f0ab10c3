"""The three vision-language families behind one protocol: each implements every `VisionLanguageKind` member, and
the images it places carry what its decoder needs (Qwen2.5-VL: M-RoPE grid positions; Gemma 3: bidirectional
spans; LLaVA: neither). Each family's own file checks its numbers against transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.vision_models import image
from engine.multimodal.inputs import ImageInput
from engine.multimodal.kind import VisionLanguageKind
from engine.multimodal.prompt import expand_image_prompt
from engine.multimodal.registry import FAMILIES, vision_kind_for

# fixture -> (M-RoPE positions, bidirectional images)
EXPECTED = {"llava_folder": (False, False), "qwen2_5_vl_folder": (True, False), "gemma3_folder": (False, True)}


def _protocol_members() -> set[str]:
    annotated = set(VisionLanguageKind.__annotations__)
    methods = {name for name, value in vars(VisionLanguageKind).items() if callable(value) and not name.startswith("_")}
    return annotated | methods


def test_every_family_implements_the_whole_protocol() -> None:
    members = _protocol_members()
    assert {"expand", "bidirectional_images", "rotary_positions", "preprocess", "route"} <= members
    for family in FAMILIES.values():
        missing = {name for name in members - {"image_token_id", "pixel_shape"} if not hasattr(family, name)}
        assert not missing, (family.__name__, missing)


@pytest.mark.parametrize("fixture", sorted(EXPECTED))
def test_placed_images_carry_what_the_family_needs(fixture: str, request: pytest.FixtureRequest) -> None:
    folder: Path = request.getfixturevalue(fixture)
    kind = vision_kind_for(json.loads((folder / "config.json").read_text()), folder)
    assert kind is not None
    grid_positions, bidirectional = EXPECTED[fixture]
    assert kind.bidirectional_images is bidirectional
    mark = getattr(kind, "boi_token_id", kind.image_token_id)  # the token the chat template writes per image
    prompt = [11, mark, 12, 13, mark, 14]  # plain words in every tiny tokenizer
    expanded, placed = expand_image_prompt(kind, prompt, [ImageInput(image(1, 40, 33)), ImageInput(image(2, 60, 25))])
    assert len(placed) == 2
    for one in placed:
        assert expanded[one.offset : one.stop] == [kind.image_token_id] * one.length
        assert one.bidirectional is bidirectional
        assert (one.rotary_positions is not None) is grid_positions
        if grid_positions:  # [3, length], fewer positions than placeholders
            assert one.rotary_positions.shape == (3, one.length) and one.rotary_positions.dtype == torch.int64
            assert one.position_span < one.length
        else:
            assert one.position_span == one.length
