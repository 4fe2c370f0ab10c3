"""Text <-> token ids and chat prompts, from a Hugging Face folder, without importing transformers."""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import processors


class Tokenizer:
    """A `tokenizers` tokenizer plus what tokenizer_config.json adds: special tokens, BOS/EOS policy, chat template."""

    def __init__(self, backend: HFTokenizer, tokenizer_config: dict[str, Any], chat_template: str | None) -> None:
        self._backend = backend
        self._special_tokens = {
            name: token
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (token := _token_text(tokenizer_config.get(name))) is not None
        }
        self.bos_token_id: int | None = self._id_of(self._special_tokens.get("bos_token"))
        self.eos_token_id: int | None = self._id_of(self._special_tokens.get("eos_token"))
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self.all_special_ids: frozenset[int] = frozenset(
            token_id for token_id, token in backend.get_added_tokens_decoder().items() if token.special
        )
        # Like transformers: an explicit add_bos_token/add_eos_token overrides tokenizer.json's post-processor.
        if "add_bos_token" in tokenizer_config or "add_eos_token" in tokenizer_config:
            add_bos = tokenizer_config.get("add_bos_token") and self.bos_token_id is not None
            add_eos = tokenizer_config.get("add_eos_token") and self.eos_token_id is not None
            backend.post_processor = bos_eos_processor(
                bos=(self._special_tokens["bos_token"], self.bos_token_id) if add_bos else None,
                eos=(self._special_tokens["eos_token"], self.eos_token_id) if add_eos else None,
            )
        self.chat_template: str | None = chat_template  # the jinja source, None when the folder has none
        self._chat_template = _compile_chat_template(chat_template) if chat_template else None

    @classmethod
    def from_folder(cls, path: Path) -> "Tokenizer":
        path = Path(path)
        if not (path / "tokenizer.json").is_file():
            raise ValueError(f"{path} has no tokenizer.json")
        config_path = path / "tokenizer_config.json"
        config = json.loads(config_path.read_text(encoding="utf-8")) if config_path.is_file() else {}
        return cls(HFTokenizer.from_file(str(path / "tokenizer.json")), config, _chat_template(path, config))

    @property
    def backend(self) -> HFTokenizer:
        """The `tokenizers` object itself, for libraries that read the vocabulary (the grammar compiler)."""
        return self._backend

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The template rendered as transformers renders it: `tools` (OpenAI tool dicts) is passed even when
        None, so templates testing `tools is not none` behave as under transformers; `template_kwargs` are further
        variables the template reads (Qwen3's `enable_thinking`), as transformers passes its extra keyword arguments.
        Image parts reach the template as given (`{"type": "image", ...}`), as transformers' processors pass them:
        the template writes the model's image token for each."""
        if self._chat_template is None:
            raise ValueError("this model's tokenizer has no chat template; send a plain text prompt instead")
        return self._chat_template.render(
            messages=messages,
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            **self._special_tokens,
            **template_kwargs,
        )

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._backend.token_to_id(token)



def bos_eos_processor(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> processors.TemplateProcessing:
    """Wraps every encoded text in the given (token, id) BOS and EOS; None leaves that side bare."""
    prefix = f"{bos[0]} " if bos else ""
    suffix = f" {eos[0]}" if eos else ""
    return processors.TemplateProcessing(
        single=f"{prefix}$A{suffix}",
        pair=f"{prefix}$A{suffix} {prefix}$B:1{suffix}",
        special_tokens=[token for token in (bos, eos) if token],
    )


def _token_text(token: str | dict[str, Any] | None) -> str | None:
    # tokenizer_config.json spells a special token either as text or as a serialized AddedToken.
    return token.get("content") if isinstance(token, dict) else token


def _chat_template(folder: Path, tokenizer_config: dict[str, Any]) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        template = next((entry["template"] for entry in template if entry.get("name") == "default"), None)
    if template is None and (folder / "chat_template.jinja").is_file():  # how transformers >= 4.50 saves it
        template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
    if template is None and (folder / "chat_template.json").is_file():  # a processor's, as older transformers saves it
        template = json.loads((folder / "chat_template.json").read_text(encoding="utf-8")).get("chat_template")
    return template


def _compile_chat_template(template: str) -> jinja2.Template:
    # The same environment transformers renders chat templates in, so prompts match byte for byte.
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols, _GenerationBlock])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda format: datetime.now().strftime(format)
    return environment.from_string(template)


class _GenerationBlock(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it renders as is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.Scope(body).set_lineno(lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)
