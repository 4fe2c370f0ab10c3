"""Images in prompts: what a request carries (`inputs`), how a model family expands and preprocesses them (`kind`,
one module per family: `llava`, `gemma3`), the HF-equal CLIP-style preprocessing (`image_processor`), and the
engine step's vision encoder pass with its output cache (`encoder_cache`, `encoder_step`)."""

from engine.multimodal.inputs import ImageInput, PlacedImage

__all__ = ["ImageInput", "PlacedImage"]
