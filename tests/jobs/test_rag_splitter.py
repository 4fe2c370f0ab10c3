"""The RAG splitter: chunks within the token budget, cut at the best boundary, slices of the source text.

Budgets are small and derived from the real all-MiniLM-L6-v2 tokenizer's counts, so that each document
forces the choice the test is about. No model weights, services or GPU needed.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from engine.model_registry import DEFAULT_EMBEDDING_MODEL, resolve_embedding_model
from jobs.rag.documents import extract_text
from jobs.rag.splitter import Boundary, Passage, SplitterConfig, TextSplitter, _Boundaries
from tests.jobs.test_rag_documents import ARTICLE_HTML, TWO_PAGE_PDF, pdf_with_pages

TokenCounter = Callable[[str], int]

# Each sentence below is 8 to 15 tokens long.
SENTENCES = [
    "The embedding model reads at most a fixed number of tokens.",
    "Longer inputs are truncated and their tail is lost.",
    "Splitting documents first keeps every part searchable.",
    "Each chunk should read well on its own.",
    "Boundaries between sections make the best cuts.",
    "Paragraph breaks come next, then sentences, then words.",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    """As the model folder has it: truncating and padding to 128, which the splitter must undo."""
    return Tokenizer.from_file(str(resolve_embedding_model(DEFAULT_EMBEDDING_MODEL) / "tokenizer.json"))


@pytest.fixture(scope="module")
def base_splitter(tokenizer: Tokenizer) -> TextSplitter:
    return TextSplitter(tokenizer)


@pytest.fixture(scope="module")
def count_tokens(base_splitter: TextSplitter) -> TokenCounter:
    return base_splitter.count_tokens


def make_splitter(tokenizer: Tokenizer, chunk_tokens: int, overlap_tokens: int = 0) -> TextSplitter:
    return TextSplitter(tokenizer, SplitterConfig(chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens))


def assert_valid_chunks(splitter: TextSplitter, text: str, chunks: list[Passage]) -> None:
    """What holds for every split: exact slices, trimmed, in budget, truly counted, in order, covering every
    non-space character, and overlapping by at most the overlap budget."""
    config = splitter.config
    for index, chunk in enumerate(chunks):
        assert chunk.index == index
        assert text[chunk.char_start : chunk.char_end] == chunk.text
        assert chunk.text and chunk.text == chunk.text.strip()
        assert chunk.token_count == splitter.count_tokens(chunk.text) <= config.chunk_tokens
    if not chunks:
        assert not splitter.count_tokens(text)
        return
    assert not text[: chunks[0].char_start].strip() and not text[chunks[-1].char_end :].strip()
    for previous, chunk in zip(chunks, chunks[1:]):
        assert previous.char_start < chunk.char_start and previous.char_end < chunk.char_end
        if chunk.char_start >= previous.char_end:
            assert not text[previous.char_end : chunk.char_start].strip()  # nothing but whitespace skipped
        else:
            assert splitter.count_tokens(text[chunk.char_start : previous.char_end]) <= config.overlap_tokens


def texts(chunks: list[Passage]) -> list[str]:
    return [chunk.text for chunk in chunks]


# ---------------------------------------------------------------------------------------------------------
# Configuration


@pytest.mark.parametrize(
    ("chunk_tokens", "overlap_tokens", "message"),
    [
        (0, 0, "chunk_tokens must be positive"),
        (-5, 0, "chunk_tokens must be positive"),
        (16, 16, "less than chunk_tokens"),
        (16, 40, "less than chunk_tokens"),
        (16, -1, "at least 0"),
    ],
)
def test_config_is_validated(chunk_tokens: int, overlap_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SplitterConfig(chunk_tokens=chunk_tokens, overlap_tokens=overlap_tokens)


def test_config_defaults() -> None:
    assert SplitterConfig() == SplitterConfig(chunk_tokens=256, overlap_tokens=32)


def test_with_config_changes_only_the_budget(base_splitter: TextSplitter) -> None:
    text = " ".join(SENTENCES)
    small = base_splitter.with_config(SplitterConfig(chunk_tokens=12, overlap_tokens=0))
    assert base_splitter.config == SplitterConfig() and len(base_splitter.split(text)) == 1
    assert_valid_chunks(small, text, small.split(text))
    assert len(small.split(text)) > len(SENTENCES)  # some sentences are longer than 12 tokens


@pytest.mark.parametrize("text", ["", " ", "\n\n\t \r\n", "\u3000\u00a0"])
def test_empty_and_whitespace_only_documents_give_no_chunks(tokenizer: Tokenizer, text: str) -> None:
    assert make_splitter(tokenizer, 16).split(text) == []


def test_a_short_document_is_one_trimmed_chunk(tokenizer: Tokenizer) -> None:
    text = "\n\n  # Title\n\nOne short paragraph.  \n"
    splitter = make_splitter(tokenizer, 64, 8)
    [chunk] = splitter.split(text)
    assert chunk.text == "# Title\n\nOne short paragraph."
    assert (chunk.char_start, chunk.char_end) == (4, 33)
    assert_valid_chunks(splitter, text, [chunk])


def test_the_tokenizers_own_truncation_and_padding_are_ignored(tokenizer: Tokenizer) -> None:
    # all-MiniLM-L6-v2's tokenizer.json truncates and pads to 128; the splitter must see every token.
    assert tokenizer.truncation is not None and tokenizer.padding is not None
    text = " ".join(SENTENCES * 20)
    splitter = make_splitter(tokenizer, 200, 20)
    chunks = splitter.split(text)
    assert_valid_chunks(splitter, text, chunks)
    assert chunks[-1].char_end == len(text)
    assert tokenizer.truncation["max_length"] == 128  # the caller's tokenizer is left as it was


# ---------------------------------------------------------------------------------------------------------
# Boundary preferences


def test_a_heading_is_preferred_over_a_later_paragraph_break(
    tokenizer: Tokenizer, count_tokens: TokenCounter
) -> None:
    intro, section, first, second = SENTENCES[0], "## Sizes", SENTENCES[1], " ".join(SENTENCES[2:])
    text = f"{intro}\n\n{section}\n\n{first}\n\n{second}"
    # The budget reaches past the paragraph break before `second`, but the chunk still ends at the heading.
    splitter = make_splitter(tokenizer, count_tokens(f"{intro}\n\n{section}\n\n{first}\n\n") + 3)
    chunks = splitter.split(text)
    assert texts(chunks)[:2] == [intro, f"{section}\n\n{first}"]
    assert_valid_chunks(splitter, text, chunks)


def test_a_paragraph_break_is_preferred_over_a_later_sentence_end(
    tokenizer: Tokenizer, count_tokens: TokenCounter
) -> None:
    first, second = " ".join(SENTENCES[:2]), " ".join(SENTENCES[2:])
    text = f"{first}\n\n{second}"
    splitter = make_splitter(tokenizer, count_tokens(f"{first} {' '.join(SENTENCES[2:4])}") + 2)
    chunks = splitter.split(text)
    assert texts(chunks)[0] == first
    assert_valid_chunks(splitter, text, chunks)


def test_a_sentence_end_is_preferred_over_a_later_word(tokenizer: Tokenizer, count_tokens: TokenCounter) -> None:
    text = " ".join(SENTENCES)
    splitter = make_splitter(tokenizer, count_tokens(" ".join(SENTENCES[:2])) + 5)
    chunks = splitter.split(text)
    assert texts(chunks)[0] == " ".join(SENTENCES[:2])
    assert all(chunk.text.endswith(".") for chunk in chunks)
    assert_valid_chunks(splitter, text, chunks)


def test_the_furthest_boundary_of_the_best_kind_wins(tokenizer: Tokenizer, count_tokens: TokenCounter) -> None:
    paragraphs = SENTENCES[:4]
    text = "\n\n".join(paragraphs)
    splitter = make_splitter(tokenizer, count_tokens("\n\n".join(paragraphs[:3])) + 2)
    assert texts(splitter.split(text)) == ["\n\n".join(paragraphs[:3]), paragraphs[3]]


def test_an_abbreviation_does_not_end_a_sentence(tokenizer: Tokenizer, count_tokens: TokenCounter) -> None:
    first = "Budgets differ."
    second = "Models use subword tokenizers, e.g. WordPiece or BPE, to split rare words into pieces."
    text = f"{first} {second}"
    # The budget reaches "WordPiece": were "e.g." an end, the chunk would stop there instead of after `first`.
    splitter = make_splitter(tokenizer, count_tokens(f"{first} Models use subword tokenizers, e.g. WordPiece") + 1)
    chunks = splitter.split(text)
    assert texts(chunks)[0] == first
    assert_valid_chunks(splitter, text, chunks)


@pytest.mark.parametrize(
    ("text", "sentence_starts"),
    [
        ("One. Two! Three? Four.", ["Two!", "Three?", "Four."]),
        ('He said "stop." Then he left.', ["Then"]),
        ("See e.g. Python. Or i.e. this. Ask Dr. Smith. Versus vs. them.", ["Or", "Ask", "Versus"]),
        ("Pi is 3.14 today. It was 2.71 in 2020. Next year too.", ["It", "Next"]),
        ("Written by J. R. Smith. The end.", ["The"]),
        ("It costs approx. three euros. Fine etc. And more.", ["Fine", "And"]),
        ("Steps:\n1. Install it.\n2. Run it.", ["2."]),
        ("Wait... What happened?! Nothing.", ["What", "Nothing."]),
        ("東京は大きい。大阪も大きい！本当？ はい。", ["大阪も大きい！本当？", "本当？", "はい。"]),
    ],
)
def test_sentence_ends(text: str, sentence_starts: list[str]) -> None:
    found = _Boundaries.find(text).at_least[Boundary.SENTENCE]
    assert [text[position:].split()[0] for position in found] == sentence_starts


def test_an_over_long_sentence_is_cut_between_words(tokenizer: Tokenizer) -> None:
    text = " ".join(["retrieval augmented generation without any punctuation at all"] * 8)
    splitter = make_splitter(tokenizer, 12)
    chunks = splitter.split(text)
    assert len(chunks) > 3
    for chunk in chunks:
        assert chunk.char_start == 0 or text[chunk.char_start - 1] == " "
        assert chunk.char_end == len(text) or text[chunk.char_end] == " "
    assert_valid_chunks(splitter, text, chunks)


def test_an_over_long_word_is_cut_at_token_boundaries(tokenizer: Tokenizer) -> None:
    word = "pneumonoultramicroscopicsilicovolcanoconiosis"
    text = f"Lung disease: {word} is rare."
    splitter = make_splitter(tokenizer, 4, 2)
    chunks = splitter.split(text)
    assert_valid_chunks(splitter, text, chunks)
    assert "".join(chunk.text for chunk in chunks if chunk.char_start >= text.index(word))[: len(word)] == word
    token_starts = {start for start, _ in tokenizer.encode(text, add_special_tokens=False).offsets}
    assert all(chunk.char_start in token_starts for chunk in chunks)


def test_a_budget_below_a_word_pieces_own_tokenization_cuts_between_characters(tokenizer: Tokenizer) -> None:
    # "ult" is one piece ("##ult") in the word but two tokens on its own ("ul", "##t"): with a budget of one
    # token, the chunk holding it is cut again, between characters.
    word = "pneumonoultramicroscopicsilicovolcanoconiosis"
    splitter = make_splitter(tokenizer, 1)
    chunks = splitter.split(word)
    assert_valid_chunks(splitter, word, chunks)
    assert "".join(texts(chunks)) == word
    token_starts = {start for start, _ in tokenizer.encode(word, add_special_tokens=False).offsets}
    assert any(chunk.char_start not in token_starts for chunk in chunks)


def test_a_long_run_without_spaces_is_cut_between_pre_tokenizer_words(tokenizer: Tokenizer) -> None:
    url = "https://example.com/" + "/".join(f"segment{number}" for number in range(40))
    splitter = make_splitter(tokenizer, 10)
    chunks = splitter.split(url)
    assert_valid_chunks(splitter, url, chunks)
    # "segment12" is three tokens of one pre-tokenizer word; every cut falls beside a "/", never inside a word.
    assert len(chunks) > 5
    assert all(not (url[chunk.char_end - 1].isalnum() and url[chunk.char_end].isalnum()) for chunk in chunks[:-1])


# ---------------------------------------------------------------------------------------------------------
# Markdown


def test_chunks_start_at_headings_and_a_heading_stays_with_its_text(
    tokenizer: Tokenizer, count_tokens: TokenCounter
) -> None:
    sections = [f"## Part {number}\n\n{SENTENCES[number]} {SENTENCES[number + 1]}" for number in range(4)]
    text = "# Guide\n\n" + "\n\n".join(sections)
    splitter = make_splitter(tokenizer, count_tokens(sections[0]) + 8, 6)
    chunks = splitter.split(text)
    assert texts(chunks) == ["# Guide\n\n" + sections[0], *sections[1:]]  # no overlap across a heading
    assert_valid_chunks(splitter, text, chunks)


def test_a_heading_is_not_a_chunk_of_its_own_even_before_a_long_paragraph(tokenizer: Tokenizer) -> None:
    text = "## Background\n\n" + " ".join(SENTENCES)
    splitter = make_splitter(tokenizer, 30)
    chunks = splitter.split(text)
    assert chunks[0].text.startswith("## Background\n\nThe embedding model")
    assert_valid_chunks(splitter, text, chunks)


def test_hash_lines_in_a_code_block_are_not_headings() -> None:
    text = f"## Setup\n\n{SENTENCES[0]}\n\n```bash\n# install the package\npip install conveyor\n```\n\n{SENTENCES[1]}"
    boundaries = _Boundaries.find(text)
    assert boundaries.at_least[Boundary.HEADING] == [0]
    assert text.index("# install") not in boundaries.at_least[Boundary.PARAGRAPH]


def test_a_hash_without_a_space_is_not_a_heading() -> None:
    assert _Boundaries.find("Intro.\n\n#hashtag text\n\n####### seven").at_least[Boundary.HEADING] == []


def test_windows_line_endings_break_paragraphs(tokenizer: Tokenizer, count_tokens: TokenCounter) -> None:
    text = "\r\n\r\n".join(SENTENCES[:3])
    splitter = make_splitter(tokenizer, count_tokens(" ".join(SENTENCES[:2])) + 3)
    assert texts(splitter.split(text)) == ["\r\n\r\n".join(SENTENCES[:2]), SENTENCES[2]]


def test_markdown_document_offsets(tokenizer: Tokenizer) -> None:
    text = extract_text("guide.md", _markdown_guide().encode())
    splitter = make_splitter(tokenizer, 48, 8)
    chunks = splitter.split(text)
    assert len(chunks) > 5
    assert_valid_chunks(splitter, text, chunks)
    assert sum(chunk.text.startswith("#") for chunk in chunks) >= 4


# ---------------------------------------------------------------------------------------------------------
# Overlap


def test_the_next_chunk_starts_at_a_sentence_within_the_overlap(
    tokenizer: Tokenizer, count_tokens: TokenCounter
) -> None:
    text = " ".join(SENTENCES)
    overlap = count_tokens(SENTENCES[1]) + 2
    splitter = make_splitter(tokenizer, count_tokens(" ".join(SENTENCES[:2])) + 1, overlap)
    chunks = splitter.split(text)
    assert texts(chunks)[:2] == [" ".join(SENTENCES[:2]), " ".join(SENTENCES[1:3])]
    assert_valid_chunks(splitter, text, chunks)


def test_without_a_sentence_the_overlap_starts_at_the_earliest_word_in_budget(tokenizer: Tokenizer) -> None:
    text = " ".join(f"word{number}" for number in range(60))  # "word12" is two tokens: "word", "##12"
    splitter = make_splitter(tokenizer, 20, 5)
    first, second = splitter.split(text)[:2]
    assert first.text.endswith("word9")
    assert second.text.startswith("word8 ")  # 4 tokens of overlap: "word8 word9"; "##7 word8 word9" would be 5
    assert_valid_chunks(splitter, text, splitter.split(text))


def test_zero_overlap_gives_disjoint_chunks(tokenizer: Tokenizer) -> None:
    text = " ".join(SENTENCES * 4)
    chunks = make_splitter(tokenizer, 30).split(text)
    assert all(previous.char_end < chunk.char_start for previous, chunk in zip(chunks, chunks[1:]))


def test_default_budget_on_a_long_document(tokenizer: Tokenizer) -> None:
    sections = [f"## Part {number}\n\n" + "\n\n".join([" ".join(SENTENCES)] * 8) for number in range(4)]
    text = "# Handbook\n\n" + "\n\n".join(sections)
    splitter = TextSplitter(tokenizer)
    chunks = splitter.split(text)
    assert_valid_chunks(splitter, text, chunks)
    assert max(chunk.token_count for chunk in chunks) > 200  # chunks are filled, not just cut short
    overlapping = [(a, b) for a, b in zip(chunks, chunks[1:]) if b.char_start < a.char_end]
    assert overlapping  # overlap happens where a chunk did not end at a heading


# ---------------------------------------------------------------------------------------------------------
# Extracted documents and Unicode


def test_html_extracted_text_offsets(tokenizer: Tokenizer) -> None:
    text = extract_text("guide.html", ARTICLE_HTML.encode())
    splitter = make_splitter(tokenizer, 24, 6)
    chunks = splitter.split(text)
    assert chunks[0].text.startswith("# Chunking documents for retrieval")
    assert any(chunk.text.startswith("## Choosing a chunk size") for chunk in chunks)
    assert_valid_chunks(splitter, text, chunks)


def test_pdf_extracted_text_offsets(tokenizer: Tokenizer) -> None:
    pages = [SENTENCES[page : page + 3] for page in range(4)]
    text = extract_text("report.pdf", pdf_with_pages(pages))
    splitter = make_splitter(tokenizer, 30, 8)
    chunks = splitter.split(text)
    assert_valid_chunks(splitter, text, chunks)
    assert texts(make_splitter(tokenizer, 24).split(extract_text("q.pdf", TWO_PAGE_PDF))) == [
        "Quarterly report.\nRevenue grew by 12.5 percent.",
        "Outlook.\nWe expect further growth, e.g. in Europe.",
    ]


def test_unicode_offsets_are_character_offsets(tokenizer: Tokenizer) -> None:
    text = (
        "# Café naïve résumé\n\nZürich’s crème brûlée costs 7,50 € 😀👍🏽. "
        "東京は日本の首都です。大阪は西にあります。\n\n"
        "Emoji sequences like 👩‍👩‍👧 and flags 🇫🇷 count too. Ça va? Très bien!"
    ) * 3
    splitter = make_splitter(tokenizer, 14, 4)
    chunks = splitter.split(text)
    assert len(chunks) > 6
    assert_valid_chunks(splitter, text, chunks)
    assert any(chunk.text.startswith("大阪") for chunk in chunks)  # "。" ends a sentence without a space


def test_cjk_without_punctuation_is_cut_between_characters(tokenizer: Tokenizer) -> None:
    text = "東京大阪名古屋札幌福岡" * 6
    splitter = make_splitter(tokenizer, 8, 2)
    chunks = splitter.split(text)
    assert "".join(chunk.text for chunk in chunks) == text  # no overlap: no boundary inside the run
    assert_valid_chunks(splitter, text, chunks)


# Markdown features, long and short words, numbers, CJK and emoji, newlines and spaces of several kinds.
_PIECES = st.sampled_from(
    [*SENTENCES, "# Title", "## Section", "### Sub", "\n", "\n\n", "\r\n\r\n", " ", "  ", "\t", "e.g.", "Dr.",
     "3.14", "1.", "?", "!", "。", "東京", "😀", "é", "é", "pneumonoultramicroscopicsilicovolcanoconiosis",
     "https://example.com/a/b?c=d", "```", "# comment", "\u00a0", "\u200b", "\x00", "word"]
)


@settings(max_examples=200, deadline=None)
@given(pieces=st.lists(_PIECES, max_size=80), chunk_tokens=st.integers(1, 40), overlap_fraction=st.floats(0, 0.9))
def test_every_split_is_valid(
    base_splitter: TextSplitter, pieces: list[str], chunk_tokens: int, overlap_fraction: float
) -> None:
    text = "".join(pieces)
    splitter = base_splitter.with_config(SplitterConfig(chunk_tokens, int(chunk_tokens * overlap_fraction)))
    assert_valid_chunks(splitter, text, splitter.split(text))


def test_a_megabyte_splits_in_linear_time(tokenizer: Tokenizer) -> None:
    rng = random.Random(0)
    paragraphs: list[str] = []
    length = 0
    while length < 1_000_000:
        heading = f"## Section {len(paragraphs)}\n\n" if rng.random() < 0.1 else ""
        paragraphs.append(heading + " ".join(rng.choices(SENTENCES, k=rng.randint(1, 8))))
        length += len(paragraphs[-1]) + 2
    text = "\n\n".join(paragraphs)[:1_000_000]
    splitter = TextSplitter(tokenizer)
    started = time.perf_counter()
    chunks = splitter.split(text)
    elapsed = time.perf_counter() - started
    # 0.63 s on a slow 2-core machine, most of it the tokenizer; re-encoding growing prefixes (quadratic)
    # would take hours.
    assert elapsed < 6.0
    assert chunks[-1].char_end == len(text.rstrip())


def _markdown_guide() -> str:
    sections = []
    for number in range(6):
        paragraphs = [" ".join(SENTENCES[(number + k) % 6 : (number + k) % 6 + 3]) for k in range(3)]
        sections.append(f"## Step {number + 1}\n\n" + "\n\n".join(paragraphs))
    return "# A guide\n\nWhat this guide covers, e.g. chunking.\n\n" + "\n\n".join(sections) + "\n"
