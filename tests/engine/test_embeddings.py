"""Embeddings: the engine's `Embedder` equals sentence-transformers' `encode` on the same model folder
(cosine >= 0.9999 in float32), one text at a time and in packed batches of mixed lengths, in input order."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
import torch

from engine import Embedder
from engine.config import EmbedderConfig, EncoderConfig
from engine.dtypes import cpu_has_fast_bf16
from engine.embedder import SentenceEmbeddingRecipe
from engine.embedding_model import AttentionLayout, EncoderModel, pool, stable_row_count
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, resolve_embedding_model
from conveyor_kernels.cpu_kernels import encoder_kernels_available

if TYPE_CHECKING:
    from sentence_transformers import SentenceTransformer  # a test-only dependency

MIN_COSINE = 0.9999
LONG_TEXT = " ".join(f"word{i} of a long chunk that runs past the model's limit." for i in range(200))
TEXTS = [
    "What is the capital of France?",
    "",
    LONG_TEXT,
    "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen.",
    "Hi!",
    "What is the capital of France?",  # a duplicate: both copies must come back, each in its place
    "A retrieval pipeline splits documents into chunks, embeds each chunk, and stores the vectors in an index "
    "so that a question can be answered from the few chunks whose vectors lie nearest to its own.",
    "naïve café déjà vu — unicode, accents and punctuation!?",
]


@pytest.fixture(scope="module")
def folder() -> Path:
    return resolve_embedding_model(DEFAULT_EMBEDDING_MODEL)


@pytest.fixture(scope="module")
def reference(folder: Path) -> SentenceTransformer:
    sentence_transformers = pytest.importorskip("sentence_transformers")
    return sentence_transformers.SentenceTransformer(str(folder), device="cpu")


@pytest.fixture(scope="module")
def expected(reference: SentenceTransformer) -> np.ndarray:
    return reference.encode(TEXTS, batch_size=4, convert_to_numpy=True, show_progress_bar=False)


@pytest.fixture(scope="module")
def embedder() -> Embedder:
    return Embedder(DEFAULT_EMBEDDING_MODEL, dtype="float32", device="cpu")


def cosines(actual: np.ndarray, expected: np.ndarray) -> np.ndarray:
    return (actual * expected).sum(axis=1) / (np.linalg.norm(actual, axis=1) * np.linalg.norm(expected, axis=1))


@pytest.mark.slow
def test_single_inputs_match_sentence_transformers(embedder: Embedder, expected: np.ndarray) -> None:
    for text, row in zip(TEXTS, expected):
        result = embedder.embed(text)
        assert result.vectors.shape == (1, 384) and result.vectors.dtype == np.float32
        assert cosines(result.vectors, row[None])[0] >= MIN_COSINE, text[:40]


@pytest.mark.slow
# Token counts, longest first: 256, 42, 17, 17, 9, 9, 4, 2. A 300-token budget packs [256, 42] and then the rest,
# whose equal lengths share attention calls; a 1-token budget sends every text alone.
@pytest.mark.parametrize(("max_batch_tokens", "expected_batches"), [(8192, 1), (300, 2), (1, len(TEXTS))])
def test_packed_batches_match_sentence_transformers_in_input_order(
    expected: np.ndarray, max_batch_tokens: int, expected_batches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    embedder = Embedder(dtype="float32", device="cpu", config=EmbedderConfig(max_batch_tokens=max_batch_tokens))
    batches: list[list[int]] = []  # each forward pass's sequence lengths
    forward = embedder.model.forward

    def recording_forward(input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        batches.append(list(seq_lens))
        return forward(input_ids, positions, seq_lens)

    monkeypatch.setattr(embedder.model, "forward", recording_forward)
    result = embedder.embed(TEXTS)
    assert (cosines(result.vectors, expected) >= MIN_COSINE).all(), cosines(result.vectors, expected)
    # No padding: every token went through the model exactly once, within the budget (or alone).
    assert sorted(length for batch in batches for length in batch) == sorted(result.token_counts)
    assert all(sum(batch) <= max_batch_tokens or len(batch) == 1 for batch in batches)
    assert len(batches) == expected_batches


@pytest.mark.slow
def test_token_counts_follow_sentence_transformers_truncation(
    embedder: Embedder, reference: SentenceTransformer
) -> None:
    counts = embedder.embed(TEXTS).token_counts
    assert counts == [reference.tokenize([text])["input_ids"].shape[1] for text in TEXTS]
    assert embedder.max_seq_length == reference.max_seq_length == 256
    assert counts[TEXTS.index(LONG_TEXT)] == 256 and counts[TEXTS.index("")] == 2  # [CLS] [SEP]


@pytest.mark.slow
def test_bfloat16_stays_close_to_float32_sentence_transformers(expected: np.ndarray) -> None:
    """On a CPU with fast bf16 this runs the oneDNN-prepacked projections with the GELU fused, and with AMX
    the C++ attention and LayerNorm kernels."""
    embedder = Embedder(dtype="bfloat16", device="cpu", config=EmbedderConfig(max_batch_tokens=300))
    assert (embedder.model.layers[0].intermediate.packed_weight is not None) == cpu_has_fast_bf16()
    assert embedder.model.cpp_kernels == (cpu_has_fast_bf16() and encoder_kernels_available())
    assert (cosines(embedder.embed(TEXTS).vectors, expected) >= 0.999).all()


def test_vectors_are_unit_length_as_the_normalize_module_asks(embedder: Embedder) -> None:
    result = embedder.embed(TEXTS)
    assert embedder.recipe.normalize and embedder.recipe.pooling_modes == ("mean",)
    np.testing.assert_allclose(np.linalg.norm(result.vectors, axis=1), 1.0, rtol=1e-5)
    assert result.total_tokens == sum(result.token_counts)


def test_no_texts_give_an_empty_matrix(embedder: Embedder) -> None:
    result = embedder.embed([])
    assert result.vectors.shape == (0, 384) and result.token_counts == []


@pytest.mark.slow
def test_pytorch_bin_checkpoint_with_bert_prefix_loads_the_same(
    folder: Path, tmp_path: Path, embedder: Embedder
) -> None:
    """Older exports: pytorch_model.bin, names under `bert.`, a pooler the embeddings do not use."""
    from safetensors.torch import load_file

    for item in folder.iterdir():
        if item.name != "model.safetensors":
            (tmp_path / item.name).symlink_to(item)
    state = {f"bert.{name}": tensor for name, tensor in load_file(str(folder / "model.safetensors")).items()}
    state["bert.pooler.dense.weight"] = torch.zeros(384, 384)
    torch.save(state, tmp_path / "pytorch_model.bin")
    from_bin = Embedder(str(tmp_path), dtype="float32", device="cpu").embed(TEXTS[:3]).vectors
    np.testing.assert_array_equal(from_bin, embedder.embed(TEXTS[:3]).vectors)


def test_a_checkpoint_missing_a_tensor_is_refused(folder: Path) -> None:
    from safetensors.torch import load_file

    config = EncoderConfig.from_hf(json.loads((folder / "config.json").read_text()))
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["encoder.layer.3.attention.self.key.bias"]
    with pytest.raises(ValueError, match=r"missing 1 tensors, e.g. \['layers.3.qkv_proj.bias\[1\]'\]"):
        EncoderModel(config).load_weights(tensors.items())


@pytest.mark.parametrize(
    "modes", [("mean",), ("cls",), ("max",), ("mean_sqrt_len_tokens",), ("lasttoken",), ("cls", "mean", "max")]
)
def test_pooling_matches_sentence_transformers_pooling(modes: tuple[str, ...]) -> None:
    models = pytest.importorskip("sentence_transformers.models")
    seq_lens = [5, 1, 3, 7]
    tokens = torch.randn(sum(seq_lens), 16, generator=torch.Generator().manual_seed(0))
    padded = torch.zeros(len(seq_lens), max(seq_lens), 16)
    mask = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int64)
    for i, (sequence, length) in enumerate(zip(tokens.split(seq_lens), seq_lens)):
        padded[i, :length], mask[i, :length] = sequence, 1
    module = models.Pooling(16, pooling_mode=modes[0] if len(modes) == 1 else modes)
    expected = module({"token_embeddings": padded, "attention_mask": mask})["sentence_embedding"]
    torch.testing.assert_close(pool(tokens, torch.tensor(seq_lens), modes), expected)


def test_attention_layout_pads_sequences_for_attention_only() -> None:
    seq_lens = [17, 3, 32, 20, 16]  # 88 stream rows, then 8 that belong to no sequence
    layout = AttentionLayout.build(seq_lens, 96, stable_row_count, torch.device("cpu"))
    real_keys = [None if mask is None else mask.flatten(1).sum(1).tolist() for _, _, mask in layout.groups]
    assert [(count, length) for count, length, _ in layout.groups] == [(3, 32), (2, 16)]
    assert real_keys == [[17, 32, 20], [3, 16]]  # per sequence; its padding keys are masked
    assert layout.gather[layout.scatter[:88]].tolist() == list(range(88))  # each token's padded row holds it
    assert layout.gather.numel() == stable_row_count(3 * 32 + 2 * 16)
    unpadded = AttentionLayout.build([16, 32], 48, stable_row_count, torch.device("cpu"))
    assert unpadded.groups == [(1, 16, None), (1, 32, None)]


def test_stable_row_counts_add_a_sixteenth_at_most_and_few_shapes() -> None:
    counts = {rows: stable_row_count(rows) for rows in range(256, 16385)}
    assert all(rows <= count <= rows * 17 / 16 for rows, count in counts.items())
    assert len(set(counts.values())) == 1 + 16 * 6  # 256, then 16 sizes per doubling up to 16384


def write_folder(folder: Path, files: dict[str, object]) -> Path:
    for name, content in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(json.dumps(content))
    return folder


BERT_SHAPE = EncoderConfig(
    vocab_size=100, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
    max_position_embeddings=64, type_vocab_size=2, layer_norm_eps=1e-12, gelu_approximation="none",
)


def test_recipe_of_a_folder_without_modules_json_is_mean_pooling_unnormalized(tmp_path: Path) -> None:
    recipe = SentenceEmbeddingRecipe.from_folder(write_folder(tmp_path, {"tokenizer_config.json": {}}), BERT_SHAPE)
    assert recipe == SentenceEmbeddingRecipe(max_seq_length=64, do_lower_case=False, pooling_modes=("mean",),
                                             normalize=False)


def test_recipe_reads_legacy_pooling_flags_and_new_pooling_mode(tmp_path: Path) -> None:
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ]
    legacy = {"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": True}
    folder = write_folder(tmp_path, {
        "modules.json": modules, "1_Pooling/config.json": legacy,
        "sentence_bert_config.json": {"max_seq_length": 32, "do_lower_case": True},
    })
    recipe = SentenceEmbeddingRecipe.from_folder(folder, BERT_SHAPE)
    assert recipe == SentenceEmbeddingRecipe(max_seq_length=32, do_lower_case=True, pooling_modes=("cls", "max"),
                                             normalize=False)
    write_folder(folder, {"1_Pooling/config.json": {"pooling_mode": "lasttoken"}})
    assert SentenceEmbeddingRecipe.from_folder(folder, BERT_SHAPE).pooling_modes == ("lasttoken",)


def test_recipe_refuses_modules_it_cannot_run(tmp_path: Path) -> None:
    dense = {"path": "2_Dense", "type": "sentence_transformers.models.Dense"}
    folder = write_folder(tmp_path, {"modules.json": [dense]})
    with pytest.raises(ValueError, match="unsupported sentence-transformers module"):
        SentenceEmbeddingRecipe.from_folder(folder, BERT_SHAPE)


def test_registry_resolves_the_bundled_model_and_refuses_unknown_names(folder: Path) -> None:
    assert (folder / "model.safetensors").is_file() and (folder / "modules.json").is_file()
    with pytest.raises(ValueError, match="all-minilm-l6-v2"):
        resolve_embedding_model("no-such-embedding-model")


def test_engine_exports_embedder_without_importing_torch_up_front() -> None:
    script = (
        "import sys, engine; assert 'torch' not in sys.modules; "
        "from engine import Embedder; assert 'torch' in sys.modules; print(Embedder.__module__)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "engine.embedder"


def embedding_model_installed() -> bool:
    try:
        resolve_embedding_model(DEFAULT_EMBEDDING_MODEL)
    except ValueError:
        return False
    return True


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
# A lent GPU gets a copy of the working tree only (64 MiB at most): the model's wheel is not there.
@pytest.mark.skipif(not embedding_model_installed(), reason=f"no {DEFAULT_EMBEDDING_MODEL} model wheel installed")
def test_cuda_matches_sentence_transformers(expected: np.ndarray) -> None:
    result = Embedder(dtype="float32", device="cuda", config=EmbedderConfig(max_batch_tokens=300)).embed(TEXTS)
    assert (cosines(result.vectors, expected) >= MIN_COSINE).all()
