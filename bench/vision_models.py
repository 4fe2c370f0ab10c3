"""A small random LLaVA-1.5 saved by transformers itself (a CLIP tower, a Llama, a processor folder with a word-level
tokenizer holding `<image>` and the llava-hf chat template), and images made with PIL: the engine's vision tests and
the request side's (`conveyor run`, the service) build the TINY shape once per session (`llava_folder` in
tests/conftest.py); `bench/vision.py` builds TINY or SMALL at run time. Weights are seeded, so every build of a shape
is the same model. `make_gemma3`: a tiny random Gemma 3 with its processor, for tests/engine/test_vision_gemma3.py."""

from __future__ import annotations

from dataclasses import dataclass
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


@dataclass(frozen=True)
class LlavaShape:
    """The widths of the two towers; (image_size / patch)² placeholder tokens per image."""

    image_size: int  # pixels, square after the processor's resize and centre crop
    patch: int  # pixels per patch side
    vision_hidden: int
    vision_layers: int
    text_hidden: int
    text_layers: int
    heads: int  # attention heads of both towers; the text tower has half as many KV heads


TINY = LlavaShape(image_size=28, patch=7, vision_hidden=32, vision_layers=3, text_hidden=64, text_layers=2, heads=4)
SMALL = LlavaShape(
    image_size=112, patch=14, vision_hidden=128, vision_layers=4, text_hidden=256, text_layers=4, heads=8
)


def make_llava(folder: Path, shape: LlavaShape = TINY) -> Path:
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
        size={"shortest_edge": shape.image_size + 2}, crop_size={"height": shape.image_size, "width": shape.image_size}
    )
    processor = transformers.LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=shape.patch,
        vision_feature_select_strategy="default", num_additional_image_tokens=1, chat_template=TEMPLATE,
    )
    config = transformers.LlavaConfig(
        vision_config=transformers.CLIPVisionConfig(
            hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
            num_hidden_layers=shape.vision_layers, num_attention_heads=shape.heads, image_size=shape.image_size,
            patch_size=shape.patch, projection_dim=shape.vision_hidden,
        ),
        text_config=transformers.LlamaConfig(
            vocab_size=512, hidden_size=shape.text_hidden, intermediate_size=2 * shape.text_hidden,
            num_hidden_layers=shape.text_layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads // 2,
            max_position_embeddings=512, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2,
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


GEMMA3_WORDS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>",
                "<end_of_image>", "<image_soft_token>", "user", "model", "describe", "this", "picture", "what", "is",
                "in", "it", "compare", "the", "two", "pictures", "hello", "there"]
GEMMA3_NEWLINES = ["\n" * count for count in range(1, 5)]  # Gemma's tokenizer has one token per run of newlines
GEMMA3_TEMPLATE = (  # Gemma 3's template, less its system-prompt folding
    "{{ bos_token }}{% for message in messages %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"
)


@dataclass(frozen=True)
class Gemma3Shape:
    """(image_size / patch)² SigLIP patches, average-pooled to `image_tokens` placeholder tokens per image."""

    image_size: int
    patch: int
    image_tokens: int  # mm_tokens_per_image: a square
    vision_hidden: int
    vision_layers: int
    text_hidden: int
    heads: int  # attention heads of both towers; the text tower has half as many KV heads
    sliding_window: int  # of the first text layer (sliding); the second attends globally


GEMMA3_TINY = Gemma3Shape(
    image_size=56, patch=7, image_tokens=16, vision_hidden=32, vision_layers=2, text_hidden=64, heads=4,
    sliding_window=8,
)


def make_gemma3(folder: Path, shape: Gemma3Shape = GEMMA3_TINY) -> Path:
    """A random `Gemma3ForConditionalGeneration` with its processor (Gemma3ImageProcessor, Gemma3Processor, the
    template above, a word-level tokenizer holding Gemma's image and newline tokens)."""
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    words = GEMMA3_WORDS + GEMMA3_NEWLINES
    vocab = {word: i for i, word in enumerate(words)} | {f"w{i}": i for i in range(len(words), 500)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(t, special=True) for t in GEMMA3_WORDS[:9]])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in GEMMA3_NEWLINES])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<bos>", eos_token="<eos>", unk_token="<unk>", pad_token="<pad>",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"},
    )
    size = {"height": shape.image_size, "width": shape.image_size}
    image_processor = transformers.Gemma3ImageProcessorPil(size=size, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    processor = transformers.Gemma3Processor(
        image_processor=image_processor, tokenizer=tokenizer, chat_template=GEMMA3_TEMPLATE,
        image_seq_length=shape.image_tokens,
    )
    config = transformers.Gemma3Config(
        vision_config=transformers.SiglipVisionConfig(
            hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
            num_hidden_layers=shape.vision_layers, num_attention_heads=shape.heads, image_size=shape.image_size,
            patch_size=shape.patch, vision_use_head=False,
        ),
        text_config=transformers.Gemma3TextConfig(
            vocab_size=512, hidden_size=shape.text_hidden, intermediate_size=2 * shape.text_hidden,
            num_hidden_layers=2, num_attention_heads=shape.heads, num_key_value_heads=shape.heads // 2,
            head_dim=shape.text_hidden // shape.heads, max_position_embeddings=512, sliding_window=shape.sliding_window,
            layer_types=["sliding_attention", "full_attention"], query_pre_attn_scalar=shape.text_hidden // shape.heads,
            bos_token_id=2, eos_token_id=1, pad_token_id=0,
            # wider than the default: attention that singles out tokens, so that the image mask (an image's tokens
            # see each other) moves the greedy tokens
            initializer_range=0.1,
        ),
        mm_tokens_per_image=shape.image_tokens, boi_token_index=words.index("<start_of_image>"),
        eoi_token_index=words.index("<end_of_image>"), image_token_index=words.index("<image_soft_token>"),
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForConditionalGeneration(config).eval()
    with torch.no_grad():  # the projector starts at zero: random, and spread wide, so that every image moves the tokens
        model.model.multi_modal_projector.mm_input_projection_weight.normal_(0, 2.0)
        model.model.multi_modal_projector.mm_soft_emb_norm.weight.normal_(0, 0.5)
    model.save_pretrained(folder)
    processor.save_pretrained(folder)
    return folder
