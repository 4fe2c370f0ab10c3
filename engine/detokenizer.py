"""Incremental detokenization and stop-string detection for one sequence.

Text is produced from a sliding window of token ids (a few tokens of context before the new ones,
as vLLM does) so that tokenizers which merge a leading space or split a multi-byte character across
tokens decode correctly. A trailing U+FFFD means the last token ended inside a UTF-8 character, so
that text is held back until the character completes: text is never cut inside a character.
"""

from __future__ import annotations

from collections.abc import Sequence

from engine.tokenizer import Tokenizer

_CONTEXT_TOKENS = 6  # prompt tokens kept as decoding context for the first generated tokens


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""
        self.stop = tuple(stop)
        self.include_stop = include_stop_str_in_output
        self._longest_stop = max((len(s) for s in self.stop), default=0)

    def append(self, token_id: int) -> str | None:
        """Add one generated token. Returns the stop string that matched, if one did (then `text`
        has been cut just before it, or just after it with include_stop_str_in_output)."""
        self._ids.append(token_id)
        prefix_text = self.tokenizer.decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self.tokenizer.decode(self._ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
            return None
        searched_from = max(0, len(self.text) - self._longest_stop + 1)
        self.text += full_text[len(prefix_text) :]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._find_stop(searched_from)

    def _find_stop(self, searched_from: int) -> str | None:
        # Only the new text, plus enough of the old to catch a stop string spanning the boundary.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            at = self.text.find(stop, searched_from)
            if at != -1 and (best is None or at < best[0]):
                best = (at, stop)
        if best is None:
            return None
        at, stop = best
        self.text = self.text[: at + len(stop)] if self.include_stop else self.text[:at]
        return stop
