"""Which vision-language family a checkpoint is, by the architecture in its config.json."""

from __future__ import annotations

from pathlib import Path
from collections.abc import Callable
from typing import Any

from engine.multimodal.gemma3 import Gemma3Kind
from engine.multimodal.kind import VisionLanguageKind
from engine.multimodal.llava import LlavaKind
from engine.multimodal.qwen2_5_vl import Qwen25VLKind

FAMILIES: dict[str, Callable[[dict[str, Any], Path], VisionLanguageKind]] = {
    "LlavaForConditionalGeneration": LlavaKind,
    "Qwen2_5_VLForConditionalGeneration": Qwen25VLKind,
    "Gemma3ForConditionalGeneration": Gemma3Kind,
}


def vision_kind_for(hf_config: dict[str, Any], folder: Path | None) -> VisionLanguageKind | None:
    """The family of a vision-language checkpoint, None for a text-only one. `folder` holds the processor settings
    (None for a named dummy shape, which has none)."""
    architecture = (hf_config.get("architectures") or [""])[0]
    if architecture not in FAMILIES:
        if "vision_config" in hf_config:
            raise ValueError(
                f"vision-language architecture {architecture!r} is not supported; supported: {sorted(FAMILIES)}"
            )
        return None
    if folder is None:
        raise ValueError(f"{architecture} needs its folder's processor settings")
    return FAMILIES[architecture](hf_config, folder)
