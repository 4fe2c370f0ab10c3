"""Text -> sentence embeddings with an encoder model, as sentence-transformers computes them for that folder.

    embedder = Embedder()                       # the bundled all-MiniLM-L6-v2
    result = embedder.embed(["first chunk", "second chunk"])
    result.vectors                              # [2, 384] float32, row i embeds text i
    result.token_counts                         # tokens per text after truncation

Texts are tokenized with the folder's tokenizer.json (truncated to the model's max_seq_length, never
padded), sorted longest first and packed end to end into batches of at most `max_batch_tokens` tokens;
each batch is one forward pass, then pooling and normalization as the folder's modules.json says.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import normalizers

from engine.config import EmbedderConfig, EncoderConfig
from engine.dtypes import building_on, cpu_has_fast_bf16, resolve_device, resolve_dtype
from engine.embedding_model import POOLING_MODES, EncoderModel, iter_checkpoint, pool
from engine.model_registry import DEFAULT_EMBEDDING_MODEL, resolve_embedding_model

# sentence-transformers' legacy pooling flags, in the order it concatenates the modes they turn on.
_LEGACY_POOLING_FLAGS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}


@dataclass(frozen=True)
class SentenceEmbeddingRecipe:
    """What a sentence-transformers folder adds to the encoder: truncation, pooling, normalization."""

    max_seq_length: int  # tokens per text, special tokens included; longer texts are truncated
    do_lower_case: bool  # lowercase before tokenizing (on top of what the tokenizer itself does)
    pooling_modes: tuple[str, ...]  # several are concatenated, in this order
    normalize: bool  # unit L2 norm at the end

    @classmethod
    def from_folder(cls, folder: Path, encoder: EncoderConfig) -> "SentenceEmbeddingRecipe":
        """Reads modules.json and its modules' configs. A folder without modules.json gets what
        sentence-transformers gives a plain transformers folder: mean pooling, no normalization."""
        transformer_config: dict[str, Any] = {}
        pooling_config: dict[str, Any] = {"pooling_mode": "mean"}
        normalize = False
        modules_path = folder / "modules.json"
        for module in json.loads(modules_path.read_text(encoding="utf-8")) if modules_path.is_file() else []:
            kind = module["type"].rpartition(".")[2]
            if kind == "Transformer":
                transformer_config = _read_json(folder / module["path"] / "sentence_bert_config.json")
            elif kind == "Pooling":
                pooling_config = _read_json(folder / module["path"] / "config.json")
            elif kind == "Normalize":
                normalize = True
            else:
                raise ValueError(f"unsupported sentence-transformers module {module['type']!r} in {modules_path}")
        # Without an explicit max_seq_length, sentence-transformers caps the tokenizer's limit at the positions'.
        positions = encoder.max_position_embeddings
        tokenizer_limit = _read_json(folder / "tokenizer_config.json").get("model_max_length", positions)
        max_seq_length = transformer_config.get("max_seq_length") or min(tokenizer_limit, positions)
        return cls(
            max_seq_length=int(max_seq_length),
            do_lower_case=bool(transformer_config.get("do_lower_case", False)),
            pooling_modes=_pooling_modes(pooling_config),
            normalize=normalize,
        )


@dataclass(frozen=True)
class Embeddings:
    vectors: np.ndarray  # [N, dimension] float32; row i embeds text i
    token_counts: list[int]  # tokens per text after truncation, special tokens included

    @property
    def total_tokens(self) -> int:
        return sum(self.token_counts)


class Embedder:
    """An encoder model loaded once (weights, tokenizer, pooling recipe) on one device, embedding texts on call."""

    def __init__(
        self,
        model: str = DEFAULT_EMBEDDING_MODEL,
        dtype: str | torch.dtype = "auto",
        device: str | torch.device | None = None,
        config: EmbedderConfig | None = None,
    ) -> None:
        self.config = config or EmbedderConfig()
        self.device = resolve_device(device)
        self.dtype = resolve_dtype(dtype, self.device)
        self.model_name = model
        folder = resolve_embedding_model(model)
        encoder_config = EncoderConfig.from_hf(_read_json(folder / "config.json"))
        self.recipe = SentenceEmbeddingRecipe.from_folder(folder, encoder_config)
        if self.recipe.max_seq_length > encoder_config.max_position_embeddings:
            raise ValueError(
                f"max_seq_length {self.recipe.max_seq_length} exceeds the model's "
                f"{encoder_config.max_position_embeddings} positions"
            )
        self.dimension = encoder_config.hidden_size * len(self.recipe.pooling_modes)
        self._tokenizer = _load_tokenizer(folder, self.recipe)
        with building_on(self.device, self.dtype):  # no float32 copy of the weights first
            self.model = EncoderModel(encoder_config)
        self.model.load_weights(iter_checkpoint(folder))
        if self.device.type == "cpu" and self.dtype == torch.bfloat16 and cpu_has_fast_bf16():
            self.model.pack_linears_for_cpu()  # oneDNN's blocked layout, and the FFN's GELU fused into its matmul
            self.model.use_cpp_kernels()  # attention and LayerNorm, with AMX (built on first use)
        self.model.eval()

    @property
    def max_seq_length(self) -> int:
        return self.recipe.max_seq_length

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Token ids per text, truncated to max_seq_length, special tokens included."""
        return [encoding.ids for encoding in self._tokenizer.encode_batch(list(texts))]

    @torch.inference_mode()
    def embed(self, texts: str | Sequence[str]) -> Embeddings:
        """Embed every text; rows come back in input order."""
        texts = [texts] if isinstance(texts, str) else list(texts)
        token_ids = self.tokenize(texts)
        vectors = np.empty((len(texts), self.dimension), dtype=np.float32)
        for batch in self._pack(token_ids):
            vectors[batch] = self._embed_batch([token_ids[i] for i in batch]).cpu().numpy()
        return Embeddings(vectors=vectors, token_counts=[len(ids) for ids in token_ids])

    def _pack(self, token_ids: list[list[int]]) -> list[list[int]]:
        """Indices of the texts in each batch: longest first, so equal lengths sit side by side (one attention
        call per run of them) and a batch's tokens fill the budget; a text longer than the budget goes alone."""
        batches: list[list[int]] = []
        batch_tokens = 0
        for index in sorted(range(len(token_ids)), key=lambda i: len(token_ids[i]), reverse=True):
            length = len(token_ids[index])
            if not batches or batch_tokens + length > self.config.max_batch_tokens:
                batches.append([])
                batch_tokens = 0
            batches[-1].append(index)
            batch_tokens += length
        return batches

    def _embed_batch(self, token_ids: list[list[int]]) -> torch.Tensor:  # [B, dimension] float32
        seq_lens = [len(ids) for ids in token_ids]
        input_ids = torch.tensor([token for ids in token_ids for token in ids], dtype=torch.int64)
        positions = torch.tensor([position for length in seq_lens for position in range(length)], dtype=torch.int64)
        hidden = self.model(input_ids.to(self.device), positions.to(self.device), seq_lens)
        lengths = torch.tensor(seq_lens, dtype=torch.int64, device=self.device)
        pooled = pool(hidden.float(), lengths, self.recipe.pooling_modes)
        return F.normalize(pooled, p=2, dim=1) if self.recipe.normalize else pooled


def _load_tokenizer(folder: Path, recipe: SentenceEmbeddingRecipe) -> HFTokenizer:
    tokenizer = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    # tokenizer.json may carry its exporter's padding and truncation (all-MiniLM-L6-v2's: pad to 128):
    # packing needs neither padding nor any limit but the recipe's.
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=recipe.max_seq_length)
    if recipe.do_lower_case:  # as sentence-transformers does it: a Lowercase step ahead of the normalizer
        steps = [normalizers.Lowercase()] + ([tokenizer.normalizer] if tokenizer.normalizer is not None else [])
        tokenizer.normalizer = normalizers.Sequence(steps)
    return tokenizer


def _pooling_modes(pooling_config: dict[str, Any]) -> tuple[str, ...]:
    mode = pooling_config.get("pooling_mode")
    if mode is None:  # sentence-transformers < 6 spelled the modes as flags
        modes = tuple(name for flag, name in _LEGACY_POOLING_FLAGS.items() if pooling_config.get(flag))
        modes = modes or ("mean",)
    else:
        modes = (mode,) if isinstance(mode, str) else tuple(mode)
    unsupported = [m for m in modes if m not in POOLING_MODES]
    if unsupported:
        raise ValueError(f"unsupported pooling modes {unsupported}; supported: {POOLING_MODES}")
    return modes


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
