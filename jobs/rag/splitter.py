"""A document's text → passages of at most `chunk_tokens` tokens of the embedding model, cut where the text breaks.

    splitter = TextSplitter.for_embedding_model()          # all-MiniLM-L6-v2's tokenizer
    for passage in splitter.split(text):
        text[passage.char_start:passage.char_end] == passage.text  # always: passages are slices of the source

A passage ends where the most natural boundary within its token budget is: before a Markdown heading (so the
next passage starts at it), else at a paragraph (a blank line), else at a sentence (".", "!" or "?" and
whitespace, not after an abbreviation such as "e.g." or before a lowercase word; "。！？" need no
whitespace), else between words; the furthest boundary of the best kind wins. A heading stays with the text
under it (the break after a heading line counts as a word boundary only), and "#" lines in code blocks are
not headings. Only a single word longer than the budget is cut inside, at a token boundary. Passages are
trimmed of whitespace at both edges by moving their offsets; the text itself is never rewritten.

Overlap: unless a passage ended before a heading, the next one starts at a boundary among its last
`overlap_tokens` tokens: at a heading there if there is one, else at the earliest sentence, else the earliest
word; with none there (inside one long word), it starts where the passage ended.

The document is tokenized once (offsets map tokens to characters) and boundaries are found with one regex
pass each, so splitting is linear in the document's length.
"""

from __future__ import annotations

import copy
import re
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from enum import IntEnum

from tokenizers import Tokenizer

from engine.model_registry import DEFAULT_EMBEDDING_MODEL, resolve_embedding_model

# Markdown ATX headings ("# Title", up to 3 spaces of indent) and code fences, whose "#" lines are comments.
_HEADING_OR_FENCE = re.compile(r"^[ \t]{0,3}(?:(?P<heading>#{1,6})(?=\s|$)|(?P<fence>`{3,}|~{3,}))", re.MULTILINE)
# The first character after a blank line ([^\S\n]: whitespace on the blank line, "\r" included).
_PARAGRAPH_START = re.compile(r"\n[^\S\n]*\n\s*(?=\S)")
# The first character after a sentence's end: closing quotes and brackets stay with the sentence they end.
_SENTENCE_START = re.compile(r"[.!?]+[\"'”’)\]]*\s+(?=\S)|[。！？]+[\"'”’)\]」』]*\s*(?=\S)")
_NON_SPACE = re.compile(r"\S")
# Where the tokenizing pieces may be cut: embedding models' pre-tokenizers (WordPiece's, Metaspace, byte-level
# BPE) start a new word at each of these, so no token spans one.
_PIECE_SEPARATOR = re.compile(r"[ \t\n]")
_PIECE_CHARS = 32_768

# Words whose final "." does not end a sentence even before a capital ("e.g. Python", "Dr. Smith").
# "etc." is not one: before a capital it usually does end the sentence.
_ABBREVIATIONS = frozenset(
    "e.g. i.e. cf. vs. mr. mrs. ms. dr. prof. sr. jr. st. no. nos. fig. figs. eq. eqs. al. approx. ca. "
    "inc. ltd. co. corp. dept. vol. pp. ch. sec. u.s. u.k.".split()
)
_LONGEST_ABBREVIATION = max(map(len, _ABBREVIATIONS))


@dataclass(frozen=True)
class SplitterConfig:
    chunk_tokens: int = 256  # tokens of a passage's text, special tokens not counted
    overlap_tokens: int = 32  # at most this many of a passage's last tokens begin the next passage

    def __post_init__(self) -> None:
        if self.chunk_tokens < 1:
            raise ValueError(f"chunk_tokens must be positive, got {self.chunk_tokens}")
        if not 0 <= self.overlap_tokens < self.chunk_tokens:
            raise ValueError(
                f"overlap_tokens must be at least 0 and less than chunk_tokens ({self.chunk_tokens}), "
                f"got {self.overlap_tokens}"
            )


@dataclass(frozen=True)
class Passage:
    index: int  # position among the document's passages
    text: str  # == source[char_start:char_end]
    char_start: int
    char_end: int
    token_count: int  # tokens of `text`, special tokens not counted


class Boundary(IntEnum):
    """Kinds of places a passage may end, best first (the document's end aside)."""

    HEADING = 0
    PARAGRAPH = 1
    SENTENCE = 2
    WORD = 3
    TOKEN = 4  # inside a word longer than the budget
    DOCUMENT_END = 5  # the rest of the document fits


class TextSplitter:
    """Splits texts by one tokenizer's token counts; reusable across documents and threads."""

    def __init__(self, tokenizer: Tokenizer, config: SplitterConfig | None = None) -> None:
        # A private copy without truncation or padding: the whole document must be tokenized, and tokenizer.json
        # files often carry their exporter's limits (all-MiniLM-L6-v2's truncates and pads to 128).
        self._tokenizer = Tokenizer.from_str(tokenizer.to_str())
        self._tokenizer.no_truncation()
        self._tokenizer.no_padding()
        self.config = config or SplitterConfig()

    @classmethod
    def for_embedding_model(
        cls, model: str = DEFAULT_EMBEDDING_MODEL, config: SplitterConfig | None = None
    ) -> TextSplitter:
        """A splitter counting the tokens of the model the passages will be embedded with (its tokenizer only)."""
        return cls(Tokenizer.from_file(str(resolve_embedding_model(model) / "tokenizer.json")), config)

    def with_config(self, config: SplitterConfig) -> TextSplitter:
        """This splitter with another budget (a job may choose its own), sharing the tokenizer copy."""
        splitter = copy.copy(self)
        splitter.config = config
        return splitter

    def count_tokens(self, text: str) -> int:
        """Tokens of `text` on its own, special tokens not counted."""
        return len(self._tokenizer.encode(text, add_special_tokens=False).ids)

    def split(self, text: str) -> list[Passage]:
        """The passages of `text` in order; none for a text without tokens (empty, whitespace)."""
        tokens = _tokenize(self._tokenizer, text)
        if not tokens.starts:
            return []
        return _DocumentSplit(text, tokens, _Boundaries.find(text), self).passages()


@dataclass(frozen=True)
class _Tokens:
    """A document's tokens as character positions."""

    starts: list[int]  # where each token begins, ascending
    ends: list[int]  # where each token ends
    words: list[int]  # the pre-tokenizer word each token belongs to, numbered across the document

    def index_at(self, position: int) -> int:
        """The first token that begins at or after `position`."""
        return bisect_left(self.starts, position)

    def count(self, char_start: int, char_end: int) -> int:
        """Tokens within [char_start, char_end); neither end may fall inside a token."""
        return self.index_at(char_end) - self.index_at(char_start)

    def cuts_word(self, position: int) -> bool:
        """Whether a cut at `position` splits a word: between two tokens of one pre-tokenizer word (a cut like
        "intern|ational"), or inside a token."""
        index = bisect_right(self.starts, position) - 1  # the last token beginning at or before `position`
        if index < 0:
            return False
        if self.starts[index] < position:
            return position < self.ends[index]
        return index > 0 and self.words[index] == self.words[index - 1]


def _tokenize(tokenizer: Tokenizer, text: str) -> _Tokens:
    # One encode_batch over pieces cut at whitespace rather than one encode: the pre-tokenizer splits at whitespace
    # anyway, so the tokens are the same, and a batch runs on every core where one long string runs on one.
    piece_starts = [0]
    while len(text) - piece_starts[-1] > _PIECE_CHARS:
        separator = _PIECE_SEPARATOR.search(text, piece_starts[-1] + _PIECE_CHARS)
        if separator is None:
            break
        piece_starts.append(separator.start())
    pieces = [text[start:end] for start, end in zip(piece_starts, piece_starts[1:] + [len(text)])]
    starts: list[int] = []
    ends: list[int] = []
    words: list[int] = []
    for piece_start, encoding in zip(piece_starts, tokenizer.encode_batch(pieces, add_special_tokens=False)):
        first_word = len(starts)  # word ids restart in every piece; a piece has fewer words than this
        starts.extend(piece_start + start for start, _ in encoding.offsets)
        ends.extend(piece_start + end for _, end in encoding.offsets)
        words.extend(first_word + word for word in encoding.word_ids)
    return _Tokens(starts=starts, ends=ends, words=words)


@dataclass(frozen=True)
class _Boundaries:
    """Where passages may begin, by kind; each list also holds the better kinds' positions, ascending."""

    at_least: dict[Boundary, list[int]]  # HEADING, PARAGRAPH, SENTENCE; words are found from the tokens

    @classmethod
    def find(cls, text: str) -> _Boundaries:
        headings, body_starts = _headings(text)
        below_heading = set(body_starts)  # word boundaries only: a heading stays with what follows it
        paragraphs = sorted({*headings, *(m.end() for m in _PARAGRAPH_START.finditer(text))} - below_heading)
        sentence_starts = {m.end() for m in _SENTENCE_START.finditer(text) if _ends_sentence(text, m.start(), m.end())}
        sentences = sorted({*paragraphs, *(sentence_starts - below_heading)})
        return cls(
            at_least={
                Boundary.HEADING: [position for position in headings if position not in below_heading],
                Boundary.PARAGRAPH: paragraphs,
                Boundary.SENTENCE: sentences,
            }
        )

    def last(self, kind: Boundary, after: int, up_to: int) -> int | None:
        """The last position of `kind` or better in (after, up_to]."""
        positions = self.at_least[kind]
        index = bisect_right(positions, up_to) - 1
        return positions[index] if index >= 0 and positions[index] > after else None

    def first(self, kind: Boundary, from_: int, before: int) -> int | None:
        """The first position of `kind` or better in [from_, before)."""
        positions = self.at_least[kind]
        index = bisect_left(positions, from_)
        return positions[index] if index < len(positions) and positions[index] < before else None


def _headings(text: str) -> tuple[list[int], list[int]]:
    """Where Markdown headings begin, and where each one's body begins (its first text after the heading line,
    which may be a heading itself: "# Guide" then "## Install")."""
    headings: list[int] = []
    body_starts: list[int] = []
    open_fence: str | None = None  # the fence character of the code block we are in
    for match in _HEADING_OR_FENCE.finditer(text):
        fence = match["fence"]
        if fence is not None:
            if open_fence is None:
                open_fence = fence[0]
            elif fence[0] == open_fence:
                open_fence = None
        elif open_fence is None:
            headings.append(match.start("heading"))
            line_end = text.find("\n", match.end())
            body = _NON_SPACE.search(text, line_end) if line_end >= 0 else None
            if body is not None:
                body_starts.append(body.start())
    return headings, body_starts


def _ends_sentence(text: str, punctuation_start: int, next_sentence_start: int) -> bool:
    """Whether the punctuation at `punctuation_start` ends a sentence; only a "." can be something else."""
    if text[punctuation_start] != ".":
        return True
    if text[next_sentence_start].islower():  # "approx. three", "etc. and"
        return False
    # The word the "." ends, looked at no further back than the longest abbreviation reaches.
    word_start, lowest = punctuation_start, max(0, punctuation_start - _LONGEST_ABBREVIATION)
    while word_start > lowest and not text[word_start - 1].isspace():
        word_start -= 1
    word = text[word_start : punctuation_start + 1].lower()
    if word in _ABBREVIATIONS:
        return False
    if len(word) == 2 and word[0].isalpha():  # an initial: "J. Smith"
        return False
    # A numbered list item's marker ("1. Install"), the first thing on its line; "in 2020. Then" still ends.
    line_start = text.rfind("\n", 0, word_start) + 1
    return not (word[:-1].isdigit() and not text[line_start:word_start].strip())


class _DocumentSplit:
    """One document being split: its text, tokens and boundaries, and the splitter's budget."""

    def __init__(self, text: str, tokens: _Tokens, boundaries: _Boundaries, splitter: TextSplitter) -> None:
        self.text = text
        self.tokens = tokens
        self.boundaries = boundaries
        self.splitter = splitter
        self.budget = splitter.config.chunk_tokens
        self.overlap = splitter.config.overlap_tokens

    def passages(self) -> list[Passage]:
        passages: list[Passage] = []
        start = len(self.text) - len(self.text.lstrip())
        new_text_from = start  # the previous passage's end: every passage must reach past it
        while True:
            end, kind = self._end(start, new_text_from)
            if self.tokens.cuts_word(start) or self.tokens.cuts_word(end):
                end, kind, token_count = self._fit_cut_word(start, end, kind)
            else:
                token_count = self.tokens.count(start, end)
            chunk_end = start + len(self.text[start:end].rstrip())
            passage = Passage(
                index=len(passages),
                text=self.text[start:chunk_end],
                char_start=start,
                char_end=chunk_end,
                token_count=token_count,
            )
            passages.append(passage)
            if kind is Boundary.DOCUMENT_END:
                return passages
            overlap_start = None if kind is Boundary.HEADING else self._overlap_start(passage)
            start = end if overlap_start is None else overlap_start
            new_text_from = end

    def _end(self, start: int, new_text_from: int) -> tuple[int, Boundary]:
        """Where the passage beginning at `start` ends: the document's end if the rest fits, else the last boundary
        of the best kind after both its first token and `new_text_from`, up to the first token past the budget."""
        first_token = self.tokens.index_at(start)
        if len(self.tokens.starts) - first_token <= self.budget:
            return len(self.text), Boundary.DOCUMENT_END
        after = max(self.tokens.starts[first_token], new_text_from)
        limit = self.tokens.starts[first_token + self.budget]
        for kind in (Boundary.HEADING, Boundary.PARAGRAPH, Boundary.SENTENCE):
            end = self.boundaries.last(kind, after, limit)
            if end is not None:
                return end, kind
        end = self._last_word_start(after, limit)
        if end is not None:
            return end, Boundary.WORD
        return self._word_cut(first_token, after), Boundary.TOKEN

    # Word starts are token starts after whitespace, looked up among a window's tokens: a list of every word
    # start would cost more to build than all the passages' lookups.

    def _last_word_start(self, after: int, up_to: int) -> int | None:
        """The last word start in (after, up_to]."""
        index = bisect_right(self.tokens.starts, up_to) - 1
        while index >= 0 and self.tokens.starts[index] > after:
            if self.text[self.tokens.starts[index] - 1].isspace():  # starts[index] > after >= 0
                return self.tokens.starts[index]
            index -= 1
        return None

    def _first_word_start(self, from_: int, before: int) -> int | None:
        """The first word start in [from_, before), from_ > 0."""
        index = self.tokens.index_at(from_)
        while index < len(self.tokens.starts) and self.tokens.starts[index] < before:
            if self.text[self.tokens.starts[index] - 1].isspace():
                return self.tokens.starts[index]
            index += 1
        return None

    def _word_cut(self, first_token: int, after: int) -> int:
        """Inside a word longer than the budget: the last token start within it that begins a pre-tokenizer word
        (between "http" and ":" of a URL), which tokenizes alike on its own, else the budget's last token."""
        last = first_token + self.budget
        for index in range(last, first_token, -1):
            if self.tokens.starts[index] <= after:
                break
            if self.tokens.words[index] != self.tokens.words[index - 1]:
                return self.tokens.starts[index]
        return self.tokens.starts[last]

    def _fit_cut_word(self, start: int, end: int, kind: Boundary) -> tuple[int, Boundary, int]:
        """A passage with an edge inside a word is counted afresh: on its own, "##ational" of "international" is
        tokenized as a word start, maybe into more tokens. Drops tokens from its end until it fits the budget,
        and characters once a single token is left (a budget smaller than one piece's fresh tokenization).
        Returns the end, its kind and the passage's tokens."""
        token_count = self.splitter.count_tokens(self.text[start:end])
        while token_count > self.budget and end - start > 1:
            last_token_start = self.tokens.starts[self.tokens.index_at(end) - 1]
            end, kind = (last_token_start if last_token_start > start else end - 1), Boundary.TOKEN
            token_count = self.splitter.count_tokens(self.text[start:end])
        return end, kind, token_count

    def _overlap_start(self, passage: Passage) -> int | None:
        """Where the next passage starts within `passage`'s last overlap tokens, None for nowhere."""
        first_token = self.tokens.index_at(passage.char_start)
        end_token = self.tokens.index_at(passage.char_end)
        overlap_from_token = max(end_token - self.overlap, first_token + 1)  # never the passage's own start
        if overlap_from_token >= end_token:
            return None
        region_start = self.tokens.starts[overlap_from_token]
        heading = self.boundaries.last(Boundary.HEADING, region_start - 1, passage.char_end - 1)
        if heading is not None:  # start the next passage at the section it will mostly be about
            return heading
        sentence = self.boundaries.first(Boundary.SENTENCE, region_start, passage.char_end)
        return sentence if sentence is not None else self._first_word_start(region_start, passage.char_end)
