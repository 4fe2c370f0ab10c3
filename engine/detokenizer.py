"""Incremental detokenization and stop-string detection for one sequence.

Text is produced from a sliding window of token ids (a few tokens of context before the new ones,
as vLLM does) so that tokenizers which merge a leading space or split a multi-byte character across
tokens decode correctly. A trailing U+FFFD means the last token ended inside a UTF-8 character, so
that text is held back until the character completes: text is never cut inside a character.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # prompt tokens kept as decoding context for the first generated tokens


@dataclass
class IncrementalDetokenizer:
    """One sequence's text so far. Plain data: its decoding window starts, at the first `append`, with the
    prompt's last few tokens as context."""

    tokenizer: Tokenizer
    prompt_token_ids: Sequence[int]
    stop: tuple[str, ...] = ()
    include_stop: bool = False  # include_stop_str_in_output
    text: str = ""
    _ids: list[int] = field(default_factory=list)  # the decoding window: context, then the output
    _prefix_offset: int = 0  # _ids[_prefix_offset:_read_offset] decode to the text's last part
    _read_offset: int = -1  # -1: the window has no context yet

    def append(self, token_id: int, check_stop: bool = True) -> str | None:
        """Add one generated token. Returns the stop string that matched, if one did (then `text`
        has been cut just before it, or just after it with include_stop_str_in_output). With
        check_stop False (before min_tokens, as vLLM) the text only grows."""
        if self._read_offset < 0:
            self._ids = list(self.prompt_token_ids[-_CONTEXT_TOKENS:])
            self._read_offset = len(self._ids)
        self._ids.append(token_id)
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self.tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        new_from = len(self.text)
        self.text += full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._find_stop(new_from) if check_stop else None

    def output_text(self, finished: bool) -> str:
        """`text` less, while unfinished, the tail that could still become a cut stop string (as vLLM
        does), so that streamed snapshots only ever grow."""
        if finished or self.include_stop:
            return self.text
        # While unfinished, a tail this long may still turn out to begin a stop string that is then cut.
        held_back = max((len(stop) for stop in self.stop), default=1) - 1
        return self.text[: max(0, len(self.text) - held_back)]

    def _find_stop(self, new_from: int) -> str | None:
        # A stop string must end in the new text: earlier text was searched already, or came before
        # min_tokens, when stop strings do not count.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, max(0, new_from - len(stop) + 1))
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop


def decode_complete(tokenizer: Tokenizer, token_ids: Sequence[int]) -> str:
    """Decode a finished output in one go, leaving out trailing tokens that end inside a UTF-8
    character, as IncrementalDetokenizer holds them back: a length cut never leaves a U+FFFD."""
    text = tokenizer.decode(token_ids)
    if not text.endswith("\ufffd"):
        return text
    # A character has at most 4 bytes and every token at least one, so at most 3 tokens hold an
    # unfinished one; a U+FFFD that survives dropping them is in the text itself.
    for drop in range(1, min(3, len(token_ids)) + 1):
        shorter = tokenizer.decode(token_ids[:-drop])
        if not shorter.endswith("\ufffd"):
            return shorter
    return text
