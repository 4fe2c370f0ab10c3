"""Qwen2.5-VL, on a tiny random checkpoint saved by transformers itself (a windowed vision tower of two blocks, one
of them windowed, a two-layer Qwen2 decoder with M-RoPE, the processor's settings and Qwen's chat template):
preprocessing, placeholders, M-RoPE positions and encoder rows equal transformers'; greedy float32 output equals
`generate` with the model's processor, token for token, batched with a text-only line, under chunked prefill (chunks
ending inside images), recompute and swap preemption, with the prefix cache on, with n = 2, and from the other
checkpoint layout. Images of several sizes (dynamic resolution: 6 to 20 placeholders) are made here with PIL."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bench.vision_models import QWEN_WORDS, image, qwen_processor
from engine import LLM, SamplingParams
from engine.llm_engine import LLMEngine
from engine.multimodal import ImageInput
from engine.multimodal.positions import chunk_positions, position_shift
from engine.multimodal.prompt import expand_image_prompt
from engine.outputs import RequestOutput
from conveyor_kernels.triton_utils import TRITON_AVAILABLE, interpreter_enabled
from tests.engine.vision_oracle import first_tokens as tokens, hf_greedy_run, step_chats, user

pytestmark = pytest.mark.slow

MAX_TOKENS = 8
# 56 x 84 px: a 4 x 6 patch grid, 6 placeholders (2 windows); 40 x 33: resized up to min_pixels (6 x 4 patches);
# 200 x 90: resized down to max_pixels (6 x 12 patches, 18 placeholders); TWIN: WIDE's size, other pixels.
WIDE, SMALL, TALL, TWIN = image(1, 56, 84), image(2, 40, 33), image(3, 200, 90), image(5, 56, 84)
IMAGE_PAD = QWEN_WORDS.index("<|image_pad|>")


CONVERSATIONS = [
    user("describe this picture", WIDE),
    user("compare the two pictures", SMALL, TALL),
    [{"role": "user", "content": [{"type": "text", "text": "hello there"}]}],
    user("what is in it", WIDE),
]


@pytest.fixture(scope="module")
def folder(qwen2_5_vl_folder: Path) -> Path:
    return qwen2_5_vl_folder


@pytest.fixture(scope="module")
def processor(folder: Path):
    return qwen_processor(folder)


@pytest.fixture(scope="module")
def hf_model(folder: Path):
    import transformers

    return transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()


def hf_generate(processor, model, conversation: list[dict]) -> tuple[list[int], list[float]]:
    """transformers' greedy tokens with the folder's processor, and each token's log-prob under the raw logits."""
    return hf_greedy_run(processor, model, conversation, MAX_TOKENS)


@pytest.fixture(scope="module")
def hf_runs(processor, hf_model) -> list[tuple[list[int], list[float]]]:
    return [hf_generate(processor, hf_model, conversation) for conversation in CONVERSATIONS]


@pytest.fixture(scope="module")
def expected(hf_runs: list[tuple[list[int], list[float]]]) -> list[list[int]]:
    tokens = [run[0] for run in hf_runs]
    assert len({tuple(t) for t in tokens}) == 4, "the tiny model should tell them apart"
    return tokens


def greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, n=n, logprobs=0)


def assert_equal_to_hf(outputs: list[RequestOutput], runs: list[tuple[list[int], list[float]]]) -> None:
    """The same tokens, and each token's log-prob within 1e-4 (which a position off by one, or a rotary base not
    the model's, exceeds, even where the tiny model's greedy tokens would not tell)."""
    assert tokens(outputs) == [run[0] for run in runs]
    for output, (_, hf_logprobs) in zip(outputs, runs):
        for sample in output.outputs:
            ours = [step[token] for step, token in zip(sample.logprobs, sample.token_ids)]
            assert ours == pytest.approx(hf_logprobs, abs=1e-4)


def chat(engine: LLMEngine, conversations: list[list[dict]]) -> list[RequestOutput]:
    return step_chats(engine, conversations, greedy())


def test_preprocessing_positions_and_encoder_equal_transformers(folder: Path, processor, hf_model) -> None:
    engine = LLMEngine(str(folder), dtype="float32", num_kv_blocks=32)
    assert engine.accepts_images  # what /v1/models' input_modalities reads
    kind, encoder = engine.vision_kind, engine.runner.vision.encoder
    for picture in (WIDE, SMALL, TALL, image(4, 100, 150)):
        theirs = processor(images=[picture], text="<|image_pad|>", return_tensors="pt")
        ours = kind.preprocess(ImageInput(picture))
        assert torch.equal(ours.reshape(-1, ours.shape[-1]), theirs["pixel_values"])
        assert list(ours.shape[:3]) == theirs["image_grid_thw"][0].tolist()
        assert kind.num_placeholders(ImageInput(picture)) == theirs["input_ids"].shape[1]
        with torch.no_grad():
            rows = hf_model.model.visual(theirs["pixel_values"], grid_thw=theirs["image_grid_thw"]).pooler_output
            assert torch.equal(encoder(ours[None])[0], rows)
    assert kind.pixel_shape == (1, 8, 8, 3 * 2 * 14 * 14)  # 112 x 112 px: the largest square within max_pixels
    engine.runner.vision.run_largest_batch()  # what the CUDA memory profile runs beside the largest decoder step
    assert engine.runner.vision.images_encoded == 0
    # Two images of different grids, then text: every prompt position and the first decode position
    conversation = CONVERSATIONS[1]
    text = engine.tokenizer.apply_chat_template(conversation)
    assert text == processor.apply_chat_template(conversation, add_generation_prompt=True)
    expanded, placed = expand_image_prompt(
        kind, engine.tokenizer.encode(text, add_special_tokens=False), [ImageInput(SMALL), ImageInput(TALL)]
    )
    inputs = processor(images=[SMALL, TALL], text=text, return_tensors="pt")
    assert expanded == inputs["input_ids"][0].tolist()
    assert [image.length for image in placed] == [6, 18]
    positions, deltas = hf_model.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
    )
    flat, grids = chunk_positions(0, len(expanded), 0, placed)
    ours = torch.tensor(flat).expand(3, -1).clone()
    for index, rows in grids:
        ours[:, index : index + rows.shape[1]] = rows
    assert torch.equal(ours, positions[:, 0])
    assert len(expanded) + position_shift(placed, len(expanded)) == len(expanded) + deltas.item()
    # Chunk by chunk, from any start, the positions are the same
    for size in (5, 7):
        pieces = []
        for start in range(0, len(expanded), size):
            stop = min(start + size, len(expanded))
            inside = tuple(image for image in placed if image.offset < stop and start < image.stop)
            flat, grids = chunk_positions(start, stop, position_shift(placed, start), inside)
            piece = torch.tensor(flat).expand(3, -1).clone()
            for index, rows in grids:
                piece[:, index : index + rows.shape[1]] = rows
            pieces.append(piece)
        assert torch.equal(torch.cat(pieces, dim=1), positions[:, 0])


def test_greedy_equals_transformers_batched_with_text(
    folder: Path, hf_runs: list[tuple[list[int], list[float]]]
) -> None:
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    outputs = llm.chat(CONVERSATIONS, greedy(), use_tqdm=False)
    assert_equal_to_hf(outputs, hf_runs)
    assert [output.prompt_token_ids.count(IMAGE_PAD) for output in outputs] == [6, 6 + 18, 0, 6]
    stats = llm.engine.stats()
    assert stats.images_encoded == 3  # WIDE, SMALL, TALL: the second WIDE prompt found it in the encoder cache
    assert stats.encoder_cache_hits >= 1


def test_n_samples_fork_with_their_positions(folder: Path, hf_runs: list[tuple[list[int], list[float]]]) -> None:
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    [output] = llm.chat([CONVERSATIONS[1]], greedy(n=2), use_tqdm=False)
    assert [sample.token_ids for sample in output.outputs] == [hf_runs[1][0], hf_runs[1][0]]
    assert_equal_to_hf([output], hf_runs[1:2])


def test_chunked_prefill_ends_chunks_inside_images(folder: Path, hf_runs: list[tuple[list[int], list[float]]]) -> None:
    """Chunks of 5 tokens: an image's placeholders span several steps, each step's positions start mid-grid."""
    engine = LLMEngine(
        str(folder), dtype="float32", num_kv_blocks=64, block_size=4, max_num_batched_tokens=5, max_num_seqs=2
    )
    assert_equal_to_hf(chat(engine, CONVERSATIONS), hf_runs)
    assert engine.stats().images_encoded == 3


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption(folder: Path, hf_runs: list[tuple[list[int], list[float]]], mode: str) -> None:
    engine = LLMEngine(
        str(folder), dtype="float32", num_kv_blocks=20, block_size=4, preemption_mode=mode, max_num_batched_tokens=32,
        swap_space=64 * 1024**2, enable_prefix_caching=False,
    )
    assert_equal_to_hf(chat(engine, CONVERSATIONS), hf_runs)
    assert engine.stats().preemptions.get(mode, 0) > 0


def test_prefix_cache_is_keyed_by_image_content(
    folder: Path, expected: list[list[int]], hf_runs: list[tuple[list[int], list[float]]], processor, hf_model
) -> None:
    """TWIN has WIDE's size, so the two prompts have the same tokens: only the image hash tells their blocks
    apart. The same image hits every full block; the other shares only the blocks before its placeholders."""
    engine = LLMEngine(str(folder), dtype="float32", num_kv_blocks=64, block_size=4)
    question = "describe this picture"
    assert tokens(chat(engine, [user(question, WIDE)])) == expected[:1]
    before = engine.stats().prefix_cache_hit_tokens
    assert_equal_to_hf(chat(engine, [user(question, WIDE)]), hf_runs[:1])
    same = engine.stats().prefix_cache_hit_tokens - before
    [other] = chat(engine, [user(question, TWIN)])
    different = engine.stats().prefix_cache_hit_tokens - before - same
    prompt_length = len(other.prompt_token_ids)
    assert same == (prompt_length - 1) // 4 * 4  # every full block but the last token's
    assert different == other.prompt_token_ids.index(IMAGE_PAD) // 4 * 4
    twin_run = hf_generate(processor, hf_model, user(question, TWIN))
    assert_equal_to_hf([other], [twin_run])
    assert twin_run[0] != expected[0]


def hub_layout(source: Path, target: Path) -> Path:
    """The folder as transformers 4.5x saves it (`model.visual.*`, `model.language_model.*`) with the Hub's flat
    config.json (the text model's keys at the top, `rope_scaling` of type "mrope")."""
    target.mkdir()
    for file in source.iterdir():
        if file.suffix != ".safetensors" and file.name != "config.json":
            (target / file.name).write_bytes(file.read_bytes())
    tensors = load_file(source / "model.safetensors")
    rename = lambda name: "model." + name if name.startswith("visual.") else (  # noqa: E731
        name.replace("model.", "model.language_model.", 1) if name.startswith("model.") else name
    )
    save_file({rename(name): tensor for name, tensor in tensors.items()}, target / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    text = config.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**config, **text, "rope_theta": rope["rope_theta"],
            "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]}}
    vision = flat["vision_config"]
    vision["in_chans"] = vision.pop("in_channels")
    (target / "config.json").write_text(json.dumps(flat))
    return target


def test_hub_config_and_transformers4_layout_load(
    folder: Path, tmp_path: Path, hf_runs: list[tuple[list[int], list[float]]]
) -> None:
    engine = LLMEngine(str(hub_layout(folder, tmp_path / "hub")), dtype="float32", num_kv_blocks=64, block_size=4)
    assert_equal_to_hf(chat(engine, CONVERSATIONS[:2]), hf_runs[:2])


def test_low_detail_lowers_max_pixels_as_the_processor_would(folder: Path, tmp_path: Path) -> None:
    """A folder whose max_pixels is above 512 x 512: "low" resizes within 512 x 512 px, as the processor does when
    called with that size; "auto" and "high" within the folder's bounds."""
    from engine.multimodal.qwen2_5_vl import LOW_DETAIL_PIXELS, Qwen25VLKind

    large = tmp_path / "large"
    large.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (large / name).write_bytes((folder / name).read_bytes())
    settings = json.loads((folder / "preprocessor_config.json").read_text())
    settings["size"] = {"shortest_edge": 56 * 56, "longest_edge": 1024 * 1024}
    (large / "preprocessor_config.json").write_text(json.dumps(settings))
    kind = Qwen25VLKind(json.loads((folder / "config.json").read_text()), large)
    processor = qwen_processor(large)
    picture = image(7, 700, 900)
    for detail, longest in (("high", 1024 * 1024), ("auto", 1024 * 1024), ("low", LOW_DETAIL_PIXELS)):
        ours = kind.preprocess(ImageInput(picture, detail))
        theirs = processor.image_processor(
            images=[picture], size={"shortest_edge": 56 * 56, "longest_edge": longest}, return_tensors="pt"
        )
        assert torch.equal(ours.reshape(-1, ours.shape[-1]), theirs["pixel_values"])
        assert kind.num_placeholders(ImageInput(picture, detail)) == theirs["image_grid_thw"].prod().item() // 4
    assert kind.num_placeholders(ImageInput(picture, "low")) < kind.num_placeholders(ImageInput(picture, "high"))


def test_images_are_checked(folder: Path) -> None:
    engine = LLMEngine(str(folder), dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="detail"):
        engine.add_request("a", [4, IMAGE_PAD, 7], greedy(), images=[ImageInput(WIDE, detail="ultra")])
    with pytest.raises(ValueError, match="aspect ratio"):
        engine.add_request("b", [4, IMAGE_PAD, 7], greedy(), images=[ImageInput(image(6, 1, 300))])
    short = LLMEngine(str(folder), dtype="float32", num_kv_blocks=16, max_model_len=20)
    with pytest.raises(ValueError, match="the prompt has 20 tokens"):  # 2 text tokens + 18 placeholders
        short.add_request("c", [4, IMAGE_PAD, 7], greedy(), images=[ImageInput(TALL)])
    assert not engine.has_unfinished_requests()


@pytest.mark.skipif(not TRITON_AVAILABLE or not interpreter_enabled(), reason="Triton on CPU needs TRITON_INTERPRET=1")
def test_triton_backend_on_cpu(folder: Path, hf_runs: list[tuple[list[int], list[float]]]) -> None:
    """The Triton backend: [3, T] positions rotate in torch, the decode steps' shifted [T] ones in the kernel."""
    llm = LLM(str(folder), dtype="float32", device="cpu", kernel_backend="triton", max_num_batched_tokens=16)
    assert llm.engine.kernel_backend == "triton"
    assert_equal_to_hf(llm.chat(CONVERSATIONS[:2], greedy(), use_tqdm=False), hf_runs[:2])  # the interpreter is slow


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("graphs", [True, False], ids=["cuda_graphs", "eager"])
def test_cuda_engine(folder: Path, hf_runs: list[tuple[list[int], list[float]]], graphs: bool, cuda_llm) -> None:
    """On a GPU: the encoder and the [3, T] prefill steps eagerly, decode steps (positions shifted by the images)
    replayed from CUDA graphs or not."""
    options = {"max_num_batched_tokens": 16, "cuda_graph_max_batch_size": 8 if graphs else 0}
    llm = cuda_llm(str(folder), dtype="float32", **options)
    assert (llm.engine.runner.decode_graphs is not None) == graphs
    assert tokens(llm.chat(CONVERSATIONS, greedy(), use_tqdm=False)) == [run[0] for run in hf_runs]
