"""Images in prompts: what a request carries (`inputs`), how a model family expands and preprocesses them (`kind`,
one module per family: `llava`, `qwen2_5_vl`, `gemma3`), the HF-equal preprocessing (`image_processor`: CLIP-style,
Gemma 3's too; `qwen2_vl_processing`: dynamic resolution), M-RoPE positions (`positions`), and the engine step's
vision encoder pass with its output cache (`encoder_cache`, `encoder_step`)."""

from engine.multimodal.inputs import ImageInput, PlacedImage

__all__ = ["ImageInput", "PlacedImage"]
