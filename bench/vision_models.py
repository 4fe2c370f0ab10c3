"""Small random vision-language models saved by transformers itself, each with its processor folder (a word-level
tokenizer holding the family's image tokens and a chat template like the Hub's), and images made with PIL: LLaVA-1.5
(a CLIP tower, a Llama; `make_llava`), Qwen2.5-VL (a windowed ViT, a Qwen2 decoder with M-RoPE; `make_qwen2_5_vl`)
and Gemma 3 (a SigLIP tower, a Gemma 3 decoder; `make_gemma3`). The engine's vision tests and the request side's
(`conveyor run`, the service) build each TINY shape once per session (`llava_folder`, `qwen2_5_vl_folder`,
`gemma3_folder` in tests/conftest.py); `bench/vision.py` builds each family's TINY or SMALL at run time. Weights are seeded, so
every build of a shape is the same model."""

from __future__ import annotations

import json
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


# Qwen2.5-VL: a word-level tokenizer holding the special tokens of Qwen's chat template, which is the Hub's (less its
# video and vision-id branches: images and text only reach it here).
QWEN_WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
              "<|video_pad|>", "system", "user", "assistant", "You", "are", "a", "helpful", ".", "describe", "this",
              "picture", "what", "is", "in", "it", "compare", "the", "two", "pictures", "hello", "there"]
QWEN_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}<|im_start|>system\n"
    "You are a helpful assistant.<|im_end|>\n{% endif %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n{% else %}"
    "{% for content in message['content'] %}{% if content['type'] == 'image' or 'image' in content %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif 'text' in content %}{{ content['text'] }}{% endif %}"
    "{% endfor %}<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@dataclass(frozen=True)
class QwenVLShape:
    """A Qwen2.5-VL: a windowed ViT (2 x 2 patches merged into one placeholder token) and a Qwen2 decoder with
    M-RoPE; images are resized to between `min_pixels` and `max_pixels` (multiples of 2 patches a side)."""

    patch: int  # pixels per patch side
    window: int  # pixels per attention window side (full attention in the last vision block)
    vision_hidden: int
    vision_layers: int
    vision_heads: int
    text_hidden: int
    text_layers: int
    text_heads: int  # the text tower has half as many KV heads
    min_pixels: int
    max_pixels: int


QWEN_TINY = QwenVLShape(patch=14, window=56, vision_hidden=32, vision_layers=2, vision_heads=2, text_hidden=64,
                        text_layers=2, text_heads=4, min_pixels=56 * 56, max_pixels=112 * 140)
QWEN_SMALL = QwenVLShape(patch=14, window=112, vision_hidden=128, vision_layers=4, vision_heads=4, text_hidden=256,
                         text_layers=4, text_heads=8, min_pixels=56 * 56, max_pixels=224 * 224)


def make_qwen2_5_vl(folder: Path, shape: QwenVLShape = QWEN_TINY) -> Path:
    import transformers
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # Every id of the model's 512 has a token (an id without one would decode to nothing)
    vocab = {word: i for i, word in enumerate(QWEN_WORDS)} | {f"w{i}": i for i in range(len(QWEN_WORDS), 511)}
    vocab["<unk>"] = 511
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens([AddedToken(t, special=True) for t in QWEN_WORDS[:7]])
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token="<unk>"
    )
    tokenizer.chat_template = QWEN_TEMPLATE
    image_processor = transformers.Qwen2VLImageProcessorPil(
        min_pixels=shape.min_pixels, max_pixels=shape.max_pixels, patch_size=shape.patch, merge_size=2,
        temporal_patch_size=2,
    )
    head_dim = shape.text_hidden // shape.text_heads
    section = [head_dim // 8, 3 * head_dim // 16, head_dim // 2 - head_dim // 8 - 3 * head_dim // 16]
    config = transformers.Qwen2_5_VLConfig(
        vision_config=dict(
            depth=shape.vision_layers, hidden_size=shape.vision_hidden, intermediate_size=2 * shape.vision_hidden,
            num_heads=shape.vision_heads, patch_size=shape.patch, spatial_merge_size=2, temporal_patch_size=2,
            window_size=shape.window, out_hidden_size=shape.text_hidden,
            fullatt_block_indexes=[shape.vision_layers - 1],
        ),
        text_config=dict(
            vocab_size=512, hidden_size=shape.text_hidden, intermediate_size=2 * shape.text_hidden,
            num_hidden_layers=shape.text_layers, num_attention_heads=shape.text_heads,
            num_key_value_heads=shape.text_heads // 2, max_position_embeddings=1024, rms_norm_eps=1e-6,
            rope_parameters={"rope_type": "default", "mrope_section": section, "rope_theta": 10000.0},
            bos_token_id=0, eos_token_id=QWEN_WORDS.index("<|im_end|>"),
        ),
        image_token_id=QWEN_WORDS.index("<|image_pad|>"), video_token_id=QWEN_WORDS.index("<|video_pad|>"),
        vision_start_token_id=QWEN_WORDS.index("<|vision_start|>"),
        vision_end_token_id=QWEN_WORDS.index("<|vision_end|>"), tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2_5_VLForConditionalGeneration(config).eval()
    with torch.no_grad():  # a larger spread than the init's, so that every image moves the greedy tokens
        for parameter in model.model.visual.merger.parameters():
            parameter.mul_(20)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    # The processor's parts as the Hub publishes them (preprocessor_config.json naming the processor): transformers
    # saves a Qwen2_5_VLProcessor only with its video processor, which needs torchvision.
    image_processor.save_pretrained(folder)
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    (folder / "preprocessor_config.json").write_text(json.dumps({**settings, "processor_class": "Qwen2_5_VLProcessor"}))
    return folder


def qwen_processor(folder: Path):
    """transformers' `Qwen2_5_VLProcessor` over the folder's tokenizer and image processor, without a video processor
    (transformers' needs torchvision): the oracle's processor for images and text."""
    from unittest import mock

    import transformers

    check = transformers.ProcessorMixin.check_argument_for_proper_class

    def check_present(self, name, argument):  # the absent video processor is no argument to check
        return None if argument is None else check(self, name, argument)

    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    image_processor = transformers.Qwen2VLImageProcessorPil.from_pretrained(folder)
    with mock.patch.object(transformers.ProcessorMixin, "check_argument_for_proper_class", check_present):
        return transformers.Qwen2_5_VLProcessor(
            image_processor=image_processor, tokenizer=tokenizer, chat_template=tokenizer.chat_template
        )


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
    text_layers: int  # an even number: sliding-window and global layers alternate, a sliding one first
    heads: int  # attention heads of both towers; the text tower has half as many KV heads
    sliding_window: int  # tokens a sliding-window layer attends back


GEMMA3_TINY = Gemma3Shape(
    image_size=56, patch=7, image_tokens=16, vision_hidden=32, vision_layers=2, text_hidden=64, text_layers=2,
    heads=4, sliding_window=8,
)
# As the other families' SMALL: 64 placeholders per image (16 x 16 patches pooled 2 x 2), 4 + 4 layers; the window
# shorter than an image line's prompt, so the sliding layers cut into it.
GEMMA3_SMALL = Gemma3Shape(
    image_size=224, patch=14, image_tokens=64, vision_hidden=128, vision_layers=4, text_hidden=256, text_layers=4,
    heads=8, sliding_window=32,
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
            num_hidden_layers=shape.text_layers, num_attention_heads=shape.heads, num_key_value_heads=shape.heads // 2,
            head_dim=shape.text_hidden // shape.heads, max_position_embeddings=512, sliding_window=shape.sliding_window,
            layer_types=["sliding_attention", "full_attention"] * (shape.text_layers // 2),
            query_pre_attn_scalar=shape.text_hidden // shape.heads,
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
