"""A GGUF file's vocabulary as a Hugging Face `tokenizer.json` and `tokenizer_config.json` (engine/gguf_import.py):
byte-level BPE with llama.cpp's pre-tokenizer families, or SentencePiece BPE with its merges recovered from the
vocabulary; special and user-defined tokens, BOS/EOS as the file asks, and the chat template."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from engine.tokenizer import bos_eos_processor

CONTROL_TOKEN = 3  # llama.cpp's token_type for special tokens such as <|im_start|>
USER_DEFINED_TOKEN = 4  # added tokens that are matched whole but are not special

# llama.cpp's `tokenizer.ggml.pre` names how text is split before BPE. These families are the ones
# whose split this module reproduces; each matches the `pre_tokenizer` of the original tokenizer.json.
_DIGITS_THEN_GPT2 = {"smollm", "starcoder", "refact"}  # every digit on its own, then GPT-2's regex
_GPT2 = {"gpt2", "default"}
_LLAMA3 = {"llama-bpe", "llama3", "llama-v3"}
_QWEN2 = {"qwen2"}
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_QWEN2_SPLIT = (  # Llama 3's with single digits
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    if pre in _DIGITS_THEN_GPT2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ])
    if pre in _GPT2:
        return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre in _LLAMA3 or pre in _QWEN2:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT if pre in _LLAMA3 else _QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    known = sorted(_DIGITS_THEN_GPT2 | _GPT2 | _LLAMA3 | _QWEN2)
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; supported: {known}")


def build_tokenizer(architecture: str, metadata: dict[str, Any]) -> HFTokenizer:
    kind = metadata.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tokenizer = _byte_level_tokenizer(metadata)
    elif kind == "llama":
        tokenizer = _sentencepiece_tokenizer(architecture, metadata)
    else:
        raise ValueError(
            f"GGUF vocabulary {kind!r} is not supported; supported: 'gpt2' (byte-level BPE), 'llama' (SentencePiece BPE)"
        )
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    token_types: list[int] = metadata.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tokenizer.post_processor = bos_eos_processor(
        bos=_special_token_and_id(metadata, "bos_token_id") if metadata.get("tokenizer.ggml.add_bos_token") else None,
        eos=_special_token_and_id(metadata, "eos_token_id") if metadata.get("tokenizer.ggml.add_eos_token") else None,
    )
    tokenizer.add_special_tokens([
        AddedToken(token, normalized=False, special=True)
        for token, token_type in zip(tokens, token_types) if token_type == CONTROL_TOKEN
    ])
    tokenizer.add_tokens([
        AddedToken(token, normalized=False, special=False)
        for token, token_type in zip(tokens, token_types) if token_type == USER_DEFINED_TOKEN
    ])
    return tokenizer


def _byte_level_tokenizer(metadata: dict[str, Any]) -> HFTokenizer:
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    merges = [tuple(merge.split(" ")) for merge in metadata["tokenizer.ggml.merges"]]
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    tokenizer = HFTokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    pre = metadata.get("tokenizer.ggml.pre", "default")
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    if pre in _QWEN2:
        tokenizer.normalizer = normalizers.NFC()
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _sentencepiece_tokenizer(architecture: str, metadata: dict[str, Any]) -> HFTokenizer:
    """SentencePiece BPE with byte fallback (Llama 2, Phi-3, Gemma), as transformers builds it from a GGUF: the
    file has no merges, so they come from the vocabulary, best first (by score; by file position for Gemma,
    whose scores do not follow its merge order). How a leading space is made differs by family and the file
    does not say: Llama's Metaspace prepends one to the first word, Phi-3's normalizer to the text, Gemma none."""
    tokens: list[str] = metadata["tokenizer.ggml.tokens"]
    gemma = architecture in ("gemma2", "gemma3")
    if gemma:  # runs of spaces are stored as spaces, but looked up as "▁"s
        tokens = ["▁" * len(token) if " " in token and not token.strip() else token for token in tokens]
        ranks = {token: -index for index, token in enumerate(tokens)}
    else:
        ranks = dict(zip(tokens, metadata["tokenizer.ggml.scores"]))
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    unknown = _special_token(metadata, "unknown_token_id") if gemma else None
    tokenizer = HFTokenizer(models.BPE(
        vocab=vocab, merges=_merges_from_vocabulary(vocab, ranks), unk_token=unknown, fuse_unk=True, byte_fallback=True,
    ))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tokenizer.normalizer = normalizers.Replace(" ", "▁")
        tokenizer.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    elif architecture == "phi3":
        tokenizer.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
        steps.append(decoders.Strip(" ", 1, 0))
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
        steps.append(decoders.Strip(" ", 1, 0))
    tokenizer.decoder = decoders.Sequence(steps)
    return tokenizer


def _merges_from_vocabulary(vocab: dict[str, int], ranks: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two tokens is a merge, ranked by the merged token (higher first), then by
    the longer left part, the longer right part, and the parts' ids, as transformers orders them."""
    merges: list[tuple[str, str, float]] = []
    for token, rank in ranks.items():
        pairs = [(token[:i], token[i:]) for i in range(1, len(token)) if token[:i] in vocab and token[i:] in vocab]
        pairs.sort(key=lambda pair: (vocab[pair[0]], vocab[pair[1]]))
        merges.extend((left, right, rank) for left, right in pairs)
    merges.sort(key=lambda merge: (merge[2], len(merge[0]), len(merge[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _special_token_and_id(metadata: dict[str, Any], key: str) -> tuple[str, int] | None:
    token = _special_token(metadata, key)
    return None if token is None else (token, metadata[f"tokenizer.ggml.{key}"])


def _special_token(metadata: dict[str, Any], key: str) -> str | None:
    token_id = metadata.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else metadata["tokenizer.ggml.tokens"][token_id]


def tokenizer_config(architecture: str, metadata: dict[str, Any]) -> dict[str, Any]:
    config: dict[str, Any] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "add_bos_token": bool(metadata.get("tokenizer.ggml.add_bos_token", False)),
        "add_eos_token": bool(metadata.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _special_token(metadata, "bos_token_id"),
        "eos_token": _special_token(metadata, "eos_token_id"),
        "unk_token": _special_token(metadata, "unknown_token_id"),
        "pad_token": _special_token(metadata, "padding_token_id"),
        "clean_up_tokenization_spaces": False,
        "model_max_length": metadata.get(f"{architecture}.context_length"),
    }
    if "tokenizer.chat_template" in metadata:
        config["chat_template"] = metadata["tokenizer.chat_template"]
    return config
