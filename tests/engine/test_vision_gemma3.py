"""Images in prompts on a tiny random Gemma 3 (`Gemma3ForConditionalGeneration`: SigLIP tower, pooled projector, a
two-layer Gemma 3 text model, one sliding layer of 8 tokens and one global) saved by transformers itself with its
processor (Gemma3ImageProcessor, Gemma3Processor, a Gemma-3-style template, a word-level tokenizer holding Gemma's
image and newline tokens): greedy float32 output equals transformers' `generate` token for token, batched with a
text line, under chunked prefill whose budget would cut images, recompute and swap preemption, with the prefix cache
on. An image's placeholders attend to each other both ways (transformers' token_type_ids mask): the greedy tokens
differ without it (`test_the_bidirectional_mask_moves_the_tokens`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bench.vision_models import GEMMA3_WORDS, image
from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.multimodal import ImageInput
from engine.outputs import RequestOutput
from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled
from tests.engine.test_vision_models import relayout
from tests.engine.vision_oracle import first_tokens as tokens, hf_greedy_run, step_chats, user

pytestmark = pytest.mark.slow

MAX_TOKENS = 6
RED, NOISE, WIDE = image(1, 40, 33), image(2, 25, 60), image(3, 90, 31)


CONVERSATIONS = [
    user("describe this picture", RED),
    user("compare the two pictures", NOISE, WIDE),
    [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
    user("what is in it", RED),
]


@pytest.fixture(scope="module")
def gemma3(gemma3_folder: Path) -> Path:
    return gemma3_folder


def hf_generate(folder: Path, conversations: list[list[dict]], bidirectional: bool = True) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy tokens for each conversation, with the folder's own processor, and each token's log-prob.
    `bidirectional=False` drops the image mask (token_type_ids): what a causal-only engine would compute."""
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(folder)
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    dropped = () if bidirectional else ("token_type_ids",)
    return [hf_greedy_run(processor, model, conversation, MAX_TOKENS, dropped) for conversation in conversations]


@pytest.fixture(scope="module")
def hf_runs(gemma3: Path) -> list[tuple[list[int], list[float]]]:
    return hf_generate(gemma3, CONVERSATIONS)


@pytest.fixture(scope="module")
def expected(hf_runs: list[tuple[list[int], list[float]]]) -> list[list[int]]:
    tokens = [run[0] for run in hf_runs]
    assert tokens[0] != tokens[3] and len({tuple(t) for t in tokens}) == 4, "the tiny model should tell them apart"
    return tokens


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS)


def chat(engine: LLMEngine, conversations: list[list[dict]]) -> list[RequestOutput]:
    return step_chats(engine, conversations, greedy())


def test_preprocessing_prompt_and_encoder_equal_transformers(gemma3: Path) -> None:
    import transformers

    processor = transformers.AutoProcessor.from_pretrained(gemma3)
    engine = LLMEngine(str(gemma3), dtype="float32", num_kv_blocks=32)
    assert engine.accepts_images
    kind = engine.vision_kind
    for picture in (RED, NOISE, WIDE, image(4, 12, 20)):
        ours = kind.preprocess(ImageInput(picture))
        theirs = processor(images=picture, text="<start_of_image>", return_tensors="pt")["pixel_values"][0]
        assert torch.equal(ours, theirs)
    from engine.multimodal.prompt import expand_image_prompt

    # the processor's "\n\n" around each image merge with the newlines beside them: "user\n" + "\n\n", two images'
    # "\n\n" + "\n\n", and a text starting with a newline (kept by a template that does not trim)
    conversations = [CONVERSATIONS[1], user("describe", RED)]
    texts = [engine.tokenizer.apply_chat_template(c) for c in conversations]
    texts.append(texts[1].replace("<start_of_image>describe", "<start_of_image>\ndescribe"))
    for text, images in zip(texts, ([NOISE, WIDE], [RED], [RED])):
        expanded, placed = expand_image_prompt(
            kind, engine.tokenizer.encode(text, add_special_tokens=False), [ImageInput(i) for i in images]
        )
        inputs = processor(images=images, text=text, return_tensors="pt")
        assert expanded == inputs["input_ids"][0].tolist()
        is_image = inputs["token_type_ids"][0].bool().tolist()
        assert [p for p, flag in enumerate(is_image) if flag] == [p for i in placed for p in range(i.offset, i.stop)]
        assert all(image.length == 16 and image.bidirectional for image in placed)
    assert texts[0] == processor.apply_chat_template(conversations[0], add_generation_prompt=True)
    newlines = {GEMMA3_WORDS.index("<end_of_image>"), len(GEMMA3_WORDS) + 3}  # "\n\n\n\n" between the two images
    assert newlines <= set(expand_image_prompt(kind, engine.tokenizer.encode(texts[0], add_special_tokens=False),
                                               [ImageInput(NOISE), ImageInput(WIDE)])[0])
    model = transformers.Gemma3ForConditionalGeneration.from_pretrained(gemma3, dtype=torch.float32).eval()
    pixels = torch.stack([kind.preprocess(ImageInput(p)) for p in (RED, NOISE)])
    with torch.no_grad():
        theirs = model.model.get_image_features(pixels).pooler_output
        ours = engine.runner.vision.encoder(pixels)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-4)


def test_greedy_equals_transformers_batched_with_text(
    gemma3: Path, expected: list[list[int]], hf_runs: list[tuple[list[int], list[float]]]
) -> None:
    llm = LLM(str(gemma3), dtype="float32", num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, logprobs=0)
    outputs = llm.chat(CONVERSATIONS, params, use_tqdm=False)
    assert tokens(outputs) == expected
    for output, (hf_tokens, hf_logprobs) in zip(outputs, hf_runs):
        ours = [step[token] for step, token in zip(output.outputs[0].logprobs, hf_tokens)]
        assert ours == pytest.approx(hf_logprobs, abs=1e-4)
    assert llm.engine.stats().images_encoded == 3  # the second RED prompt found it in the encoder cache


def test_the_bidirectional_mask_moves_the_tokens(gemma3: Path, hf_runs: list[tuple[list[int], list[float]]]) -> None:
    """Causal attention over the images gives other tokens and log-probs (well past the tolerance above): the tests
    here would catch an engine without the image mask."""
    causal = hf_generate(gemma3, CONVERSATIONS, bidirectional=False)
    assert [run[0] for run in causal] != [run[0] for run in hf_runs]
    for (_, theirs), (_, ours), conversation in zip(causal, hf_runs, CONVERSATIONS):
        if len(conversation[0]["content"]) > 1:
            assert max(abs(a - b) for a, b in zip(theirs, ours)) > 1e-3


@pytest.mark.parametrize("budget", [17, 19, 24])
def test_chunked_prefill_never_splits_an_image(gemma3: Path, expected: list[list[int]], budget: int) -> None:
    """Budgets whose chunk ends would fall inside the 16 placeholders (each of these splits an image when the
    scheduler does not keep it whole): a chunk stops before an image it cannot finish (right after its
    `<start_of_image>`), and the outputs stay transformers'. The fourth prompt's cached prefix ends inside its image:
    its first chunk starts there, finishing the image."""
    engine = LLMEngine(
        str(gemma3), dtype="float32", num_kv_blocks=96, block_size=4, max_num_batched_tokens=budget, max_num_seqs=2,
    )
    chunks: list[tuple[int, tuple[int, ...], tuple]] = []
    step = engine.runner.execute

    def recording(output, *args, **kwargs):
        chunks.extend((item.start_position, item.token_ids, item.images) for item in output.scheduled)
        return step(output, *args, **kwargs)

    engine.runner.execute = recording
    assert tokens(chat(engine, CONVERSATIONS)) == expected
    assert engine.stats().images_encoded == 3
    for start, ids, images in chunks:
        assert all(start + len(ids) >= image.stop for image in images), "a chunk ended inside an image"
    boi = GEMMA3_WORDS.index("<start_of_image>")
    assert any(ids[-1] == boi and len(ids) < budget for _, ids, _ in chunks), "no chunk was cut short before an image"
    assert any(start > image.offset for start, _, images in chunks for image in images), "no chunk started in one"


def test_n_samples_fork_after_the_image(gemma3: Path, expected: list[list[int]]) -> None:
    """n = 2 through the engine loop (images placed on the submitting thread): both samples are transformers'."""
    from engine.engine_loop import EngineLoop
    from engine.llm import conversation_images

    engine = LLMEngine(str(gemma3), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=20)
    conversation = CONVERSATIONS[1]
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(conversation), add_special_tokens=False)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, n=2)
    with EngineLoop(engine) as loop:
        output = loop.submit(ids, params, images=tuple(conversation_images(conversation))).result(60)
    assert [c.token_ids for c in output.outputs] == [expected[1], expected[1]]


def test_an_image_longer_than_a_step_is_refused(gemma3: Path) -> None:
    engine = LLMEngine(str(gemma3), dtype="float32", num_kv_blocks=32, max_num_batched_tokens=12)
    ids = engine.tokenizer.encode(engine.tokenizer.apply_chat_template(user("describe", RED)), add_special_tokens=False)
    with pytest.raises(ValueError, match="16 placeholder tokens, computed in one step"):
        engine.add_request("a", ids, greedy(), images=[ImageInput(RED)])


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(gemma3: Path, expected: list[list[int]], mode: str) -> None:
    engine = LLMEngine(
        str(gemma3), dtype="float32", num_kv_blocks=24, block_size=4, preemption_mode=mode, max_num_batched_tokens=24,
        swap_space=64 * 1024**2, enable_prefix_caching=False,
    )
    assert tokens(chat(engine, CONVERSATIONS)) == expected
    stats = engine.stats()
    assert stats.preemptions.get(mode, 0) > 0
    assert stats.images_encoded == 3


def test_prefix_cache_is_keyed_by_image_content(gemma3: Path, expected: list[list[int]]) -> None:
    engine = LLMEngine(str(gemma3), dtype="float32", num_kv_blocks=64, block_size=4)
    question = "describe this picture"
    assert tokens(chat(engine, [user(question, RED)])) == expected[:1]
    before = engine.stats().prefix_cache_hit_tokens
    [again] = chat(engine, [user(question, RED)])
    assert again.outputs[0].token_ids == expected[0]
    assert engine.stats().prefix_cache_hit_tokens - before == (len(again.prompt_token_ids) - 1) // 4 * 4
    [other] = chat(engine, [user(question, NOISE)])
    image_offset = other.prompt_token_ids.index(GEMMA3_WORDS.index("<image_soft_token>"))
    assert engine.stats().prefix_cache_hit_tokens - before - (len(again.prompt_token_ids) - 1) // 4 * 4 == (
        image_offset // 4 * 4
    )
    assert other.outputs[0].token_ids == hf_generate(gemma3, [user(question, NOISE)])[0][0]


def hub_name(name: str) -> str:  # google/gemma-3-*'s published layout
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1) if name.startswith("vision_tower.") else name


def transformers4_name(name: str) -> str:  # transformers 4.5x's save_pretrained layout
    name = hub_name(name)
    if name.startswith("language_model.model."):
        return "model.language_model." + name.removeprefix("language_model.model.")
    return "model." + name


@pytest.mark.parametrize("rename", [hub_name, transformers4_name], ids=["hub", "transformers4"])
def test_other_checkpoint_layouts_load(gemma3: Path, tmp_path: Path, expected: list[list[int]], rename) -> None:
    folder = relayout(gemma3, tmp_path / "relaid", rename)
    engine = LLMEngine(str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    assert tokens(chat(engine, CONVERSATIONS[:1])) == expected[:1]


def test_pan_and_scan_is_refused(gemma3: Path, tmp_path: Path) -> None:
    folder = relayout(gemma3, tmp_path / "pan", lambda name: name)
    settings = json.loads((folder / "processor_config.json").read_text())
    settings["image_processor"]["do_pan_and_scan"] = True
    (folder / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ValueError, match="pan-and-scan"):
        LLMEngine(str(folder), dtype="float32", num_kv_blocks=16)


@pytest.mark.skipif(
    not TRITON_AVAILABLE or not interpreter_enabled(), reason="Triton on CPU tensors needs TRITON_INTERPRET=1"
)
def test_triton_backend_attends_images_both_ways(gemma3: Path, expected: list[list[int]]) -> None:
    """The Triton prefill kernel takes each image's span as its tokens' key limits (under the interpreter here)."""
    engine = LLMEngine(
        str(gemma3), dtype="float32", device="cpu", kernel_backend="triton", num_kv_blocks=64, block_size=4,
        max_num_batched_tokens=24,
    )
    # the fourth conversation's tokens differ under causal attention (test_the_bidirectional_mask_moves_the_tokens)
    assert tokens(chat(engine, CONVERSATIONS[1::2])) == expected[1::2]
