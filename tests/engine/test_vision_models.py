"""Images in prompts, on a tiny random LLaVA-1.5 saved by transformers itself (tiny CLIP tower, tiny Llama, a
processor folder with a word-level tokenizer holding `<image>`): greedy float32 output equals transformers'
`generate` with the folder's processor, token for token, batched with a text-only line, under chunked prefill,
recompute and swap preemption, with the prefix cache on; the encoder-output cache and the image hash in the prefix
cache's block names each have a test that fails without them. Images are made here with PIL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.multimodal import ImageInput
from engine.outputs import RequestOutput
from bench.vision_models import WORDS, image
from tests.engine.vision_oracle import first_tokens as tokens, hf_greedy_run, step_chats, user

pytestmark = pytest.mark.slow

MAX_TOKENS = 8


def relayout(source: Path, target: Path, rename) -> Path:
    """A copy of the checkpoint folder with its tensors renamed (another transformers version's layout)."""
    target.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors":
            (target / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    save_file({rename(name): tensor for name, tensor in tensors.items()}, target / "model.safetensors")
    return target


def hub_name(name: str) -> str:  # llava-hf's published layout
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1) if name.startswith("vision_tower.") else name


def transformers4_name(name: str) -> str:  # transformers 4.52+'s save_pretrained layout
    name = hub_name(name)
    if name.startswith("language_model.lm_head."):
        return name.removeprefix("language_model.")
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


RED, NOISE, WIDE = image(1, 40, 33), image(2, 25, 60), image(3, 90, 31)


CONVERSATIONS = [
    user("describe this picture", RED),
    user("compare the two pictures", NOISE, WIDE),
    [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
    user("what is in it", RED),
]


@pytest.fixture(scope="module")
def llava(llava_folder: Path) -> Path:
    return llava_folder


def hf_generate(folder: Path, conversations: list[list[dict]]) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens for each conversation, with the folder's own processor, and each token's log-prob
    under the raw logits."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return [hf_greedy_run(processor, model, conversation, MAX_TOKENS) for conversation in conversations]


@pytest.fixture(scope="module")
def hf_runs(llava: Path) -> list[tuple[list[int], list[float]]]:
    return hf_generate(llava, CONVERSATIONS)


@pytest.fixture(scope="module")
def expected(hf_runs: list[tuple[list[int], list[float]]]) -> list[list[int]]:
    tokens = [run[0] for run in hf_runs]
    assert tokens[0] != tokens[3] and len({tuple(t) for t in tokens}) == 4, "the tiny model should tell them apart"
    return tokens


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def chat(engine: LLMEngine, conversations: list[list[dict]], **extra: object) -> list[RequestOutput]:
    return step_chats(engine, conversations, greedy(), **extra)


def test_preprocessing_and_prompt_equal_the_processor(llava: Path) -> None:
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(llava)
    engine = LLMEngine(str(llava), dtype="float32", num_kv_blocks=32)
    assert engine.accepts_images
    kind = engine.vision_kind
    for picture in (RED, NOISE, WIDE, image(4, 12, 20)):
        ours = kind.preprocess(ImageInput(picture))
        theirs = processor(images=picture, text="<image>", return_tensors="pt")["pixel_values"][0]
        assert torch.equal(ours, theirs)
    conversation = CONVERSATIONS[1]
    text = engine.tokenizer.apply_chat_template(conversation)
    assert text == processor.apply_chat_template(conversation, add_generation_prompt=True)
    from engine.multimodal.prompt import expand_image_prompt

    expanded, placed = expand_image_prompt(
        kind, engine.tokenizer.encode(text, add_special_tokens=False), [ImageInput(NOISE), ImageInput(WIDE)]
    )
    assert expanded == processor(images=[NOISE, WIDE], text=text, return_tensors="pt")["input_ids"][0].tolist()
    assert [image.length for image in placed] == [16, 16]
    engine.runner.vision.run_largest_batch()  # what the CUDA memory profile runs beside the largest decoder step
    assert engine.runner.vision.images_encoded == 0  # and it counts as no image


def test_greedy_equals_transformers_batched_with_text(
    llava: Path, expected: list[list[int]], hf_runs: list[tuple[list[int], list[float]]]
) -> None:
    llm = LLM(str(llava), dtype="float32", num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0)
    outputs = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    assert tokens(outputs) == expected
    for output, (hf_tokens, hf_logprobs) in zip(outputs, hf_runs):
        ours = [step[token] for step, token in zip(output.outputs[0].logprobs, hf_tokens)]
        assert ours == pytest.approx(hf_logprobs, abs=1e-4)
    stats = llm.engine.stats()
    assert stats.images_encoded == 3  # RED, NOISE, WIDE: the second RED prompt found it in the encoder cache
    assert stats.encoder_cache_hits >= 1


def test_engine_loop_prepares_images_off_its_thread_and_n_samples_fork(llava: Path, expected: list[list[int]]) -> None:
    from engine.engine_loop import EngineLoop
    from engine.llm import conversation_images

    engine = LLMEngine(str(llava), dtype="float32", num_kv_blocks=64, block_size=4)
    conversation = CONVERSATIONS[1]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conversation), add_special_tokens=False)
    images = tuple(conversation_images(conversation))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, n=2)
    with EngineLoop(engine) as loop:
        output = loop.submit(ids, params, images=images).result(60)
        refused = loop.submit(ids, params)  # its image token has no image
        with pytest.raises(ValueError, match="image token"):
            refused.result(60)
    assert [c.token_ids for c in output.outputs] == [expected[1], expected[1]]
    assert engine.stats().images_encoded == 2


@pytest.mark.parametrize("rename", [hub_name, transformers4_name], ids=["hub", "transformers4"])
def test_other_checkpoint_layouts_load(llava: Path, tmp_path: Path, expected: list[list[int]], rename) -> None:
    folder = relayout(llava, tmp_path / "relaid", rename)
    engine = LLMEngine(str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    assert tokens(chat(engine, CONVERSATIONS[:1])) == expected[:1]


def test_chunked_prefill_encodes_each_image_once(llava: Path, expected: list[list[int]]) -> None:
    """Chunks of 5 tokens: every image's 16 placeholders span 4 or more steps. Without the encoder cache each chunk
    would encode its image again (the second engine shows how many times)."""
    options = dict(dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=5, max_num_seqs=2)
    engine = LLMEngine(str(llava), **options)
    assert tokens(chat(engine, CONVERSATIONS)) == expected
    assert engine.stats().images_encoded == 3
    uncached = LLMEngine(str(llava), encoder_cache_tokens=0, **options)
    assert tokens(chat(uncached, CONVERSATIONS[:1])) == expected[:1]
    assert uncached.stats().images_encoded >= 4  # one per chunk reaching the image


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(llava: Path, expected: list[list[int]], mode: str) -> None:
    engine = LLMEngine(
        str(llava), dtype="float32", num_kv_blocks=16, block_size=4, preemption_mode=mode, max_num_batched_tokens=24,
        swap_space=64 * 1024**2, enable_prefix_caching=False,
    )
    assert tokens(chat(engine, CONVERSATIONS)) == expected
    stats = engine.stats()
    assert stats.preemptions.get(mode, 0) > 0
    assert stats.images_encoded == 3  # a recomputed prompt takes its image rows from the encoder cache


def test_prefix_cache_is_keyed_by_image_content(llava: Path, expected: list[list[int]]) -> None:
    """The same image with the same text hits the prefix cache; a different image with the same text shares only
    the blocks before its placeholders (without the image hash in the block names it would take them all)."""
    engine = LLMEngine(str(llava), dtype="float32", num_kv_blocks=64, block_size=4)
    question = "describe this picture"
    assert tokens(chat(engine, [user(question, RED)])) == expected[:1]
    before = engine.stats().prefix_cache_hit_tokens
    assert tokens(chat(engine, [user(question, RED)])) == expected[:1]
    same = engine.stats().prefix_cache_hit_tokens - before
    [other] = chat(engine, [user(question, NOISE)])
    different = engine.stats().prefix_cache_hit_tokens - before - same
    prompt_length = len(other.prompt_token_ids)
    assert same == (prompt_length - 1) // 4 * 4  # every full block but the last token's
    image_offset = other.prompt_token_ids.index(WORDS.index("<image>"))
    assert different == image_offset // 4 * 4  # "USER :" only
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(llava)
    model = transformers.LlavaForConditionalGeneration.from_pretrained(llava, dtype=torch.float32).eval()
    conversation = user(question, NOISE)
    inputs = processor(images=[NOISE], text=processor.apply_chat_template(conversation, add_generation_prompt=True),
                       return_tensors="pt")
    output = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False, min_new_tokens=MAX_TOKENS)
    assert other.outputs[0].token_ids == output[0, inputs["input_ids"].shape[1] :].tolist()


def test_image_requests_are_checked(llava: Path, tiny_dummy_model: Path) -> None:
    text_only = LLMEngine(str(tiny_dummy_model), load_format="dummy", dtype="float32", num_kv_blocks=8)
    assert not text_only.accepts_images
    with pytest.raises(ValueError, match="does not take images"):
        text_only.add_request("a", [5, 6], greedy(), images=[ImageInput(RED)])
    engine = LLMEngine(str(llava), dtype="float32", num_kv_blocks=16)
    image_token = WORDS.index("<image>")
    with pytest.raises(ValueError, match="1 image token"):
        engine.add_request("b", [4, image_token, 7], greedy(), images=[ImageInput(RED), ImageInput(NOISE)])
    with pytest.raises(ValueError, match="0 image token"):
        engine.add_request("c", [4, 7], greedy(), images=[ImageInput(RED)])
    with pytest.raises(ValueError, match="1 image token"):
        engine.add_request("d", [4, image_token, 7], greedy())
    with pytest.raises(ValueError, match="RGB"):
        engine.add_request("e", [4, image_token, 7], greedy(), images=[ImageInput(RED.convert("L"))])
    with pytest.raises(ValueError, match="detail"):
        engine.add_request("f", [4, image_token, 7], greedy(), images=[ImageInput(RED, detail="ultra")])
    assert not engine.has_unfinished_requests()
    short = LLMEngine(str(llava), dtype="float32", num_kv_blocks=16, max_model_len=18)
    with pytest.raises(ValueError, match="the prompt has 18 tokens"):  # 2 text tokens + 16 placeholders
        short.add_request("g", [4, image_token, 7], greedy(), images=[ImageInput(RED)])


def test_the_config_names_the_image_token(llava: Path) -> None:
    assert json.loads((llava / "config.json").read_text())["image_token_index"] == WORDS.index("<image>")
