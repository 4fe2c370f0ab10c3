"""A tiny random LLaVA-1.5 saved by transformers itself (tiny CLIP tower, tiny Llama, a processor folder with a
word-level tokenizer holding `<image>` and the llava-hf chat template), and images made with PIL: shared by the engine's
vision tests and the request side's (`conveyor run`, the service). Built once per session (`llava_folder` in
tests/conftest.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image

WORDS = ["<unk>", "<s>", "</s>", "<image>", "USER", ":", "ASSISTANT", "describe", "this", "picture", "what", "is",
         "in", "it", "compare", "the", "two", "pictures", "hello", "there"]
TEMPLATE = (  # the LLaVA-1.5 processors' template (llava-hf), less its {% generation %} marks
    "{% for message in messages %}{% if message['role'] != 'system' %}{{ message['role'].upper() + ': '}}{% endif %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' '}}"
    "{% endfor %}{% endfor %}{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)
IMAGE_SIZE, PATCH = 28, 7  # 16 placeholder tokens per image


def make_llava(folder: Path) -> Path:
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {word: i for i, word in enumerate(WORDS)} | {f"w{i}": i for i in range(len(WORDS), 500)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<image>", "<s>", "</s>")])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="</s>", unk_token="<unk>"
    )
    image_processor = transformers.CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE + 2}, crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=PATCH, vision_feature_select_strategy="default",
        num_additional_image_tokens=1, chat_template=TEMPLATE,
    )
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, image_size=IMAGE_SIZE,
            patch_size=PATCH, projection_dim=32,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
            tie_word_embeddings=False,
        ),
        image_token_index=WORDS.index("<image>"), vision_feature_layer=-2, vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
    )
    torch.manual_seed(0)
    model = transformers.LlavaForConditionalGeneration(config).eval()
    with torch.no_grad():  # a larger spread than the init's, so that every image moves the greedy tokens
        for parameter in model.model.multi_modal_projector.parameters():
            parameter.mul_(20)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder


def image(seed: int, height: int, width: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))
