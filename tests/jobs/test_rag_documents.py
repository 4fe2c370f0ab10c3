"""RAG documents: JSONL document lines and file bytes → plain text (.txt, .md, .html, .pdf). No services needed."""

from __future__ import annotations

import io
import json

import pytest
from pypdf import PdfReader, PdfWriter

from jobs.rag.documents import DocumentError, S3Uri, SourceDocument, extract_text, parse_document_line

ARTICLE_HTML = """<!DOCTYPE html>
<html lang="en">
<head><meta charset="utf-8"><title>Chunking guide | Example Docs</title></head>
<body>
  <header><nav><a href="/">Home</a> | <a href="/pricing">Pricing</a> | <a href="/login">Sign in</a></nav></header>
  <main>
    <article>
      <h1>Chunking documents for retrieval</h1>
      <p>Retrieval augmented generation answers questions from a corpus: documents are split into chunks,
      each chunk is embedded, and the chunks closest to a question are given to the model as context.</p>
      <h2>Choosing a chunk size</h2>
      <p>A chunk must fit the embedding model's window. Smaller chunks are more precise, e.g. a single
      definition, while larger ones keep more context together. Café owners in Zürich say so too.</p>
      <p>Overlap between neighbouring chunks keeps a sentence that straddles a boundary retrievable from both.</p>
    </article>
  </main>
  <footer><p>Copyright 2024 Example Corp. All rights reserved. Terms of service. Privacy policy.</p></footer>
</body>
</html>
"""

MARKDOWN = """# Install

Run `pip install conveyor`.

## Configure

Set `CONVEYOR_DATABASE_URL`, e.g. to a local PostgreSQL.
"""


def pdf_with_pages(pages: list[list[str]]) -> bytes:
    """A minimal well-formed PDF, written by hand: one Helvetica text object per page, one line per string
    (ASCII without parentheses or backslashes, which PDF strings would need escaped)."""
    objects = [b"<< /Type /Catalog /Pages 2 0 R >>", b"", b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>"]
    page_numbers = []
    for lines in pages:
        operators = b"BT /F1 12 Tf 72 720 Td 16 TL " + b" ".join(b"(%s) Tj T*" % line.encode("ascii") for line in lines)
        operators += b" ET"
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(operators), operators))
        objects.append(
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            b"/Contents %d 0 R >>" % len(objects)
        )
        page_numbers.append(len(objects))
    kids = b" ".join(b"%d 0 R" % number for number in page_numbers)
    objects[1] = b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(page_numbers))
    pdf = bytearray(b"%PDF-1.4\n")
    offsets = []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(pdf))
        pdf += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref_offset = len(pdf)
    pdf += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    pdf += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    pdf += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref_offset)
    return bytes(pdf)


TWO_PAGE_PDF = pdf_with_pages(
    [["Quarterly report.", "Revenue grew by 12.5 percent."], ["Outlook.", "We expect further growth, e.g. in Europe."]]
)


# ---------------------------------------------------------------------------------------------------------
# Document lines


def test_a_line_with_text_becomes_a_document() -> None:
    line = json.dumps({"id": "doc-1", "text": "Hello.", "metadata": {"source": "wiki", "page": 3}})
    assert parse_document_line(line) == SourceDocument(
        id="doc-1", text="Hello.", uri=None, metadata={"source": "wiki", "page": 3}
    )


def test_a_line_with_an_s3_uri_is_parsed_not_fetched() -> None:
    document = parse_document_line(b'{"id": "d", "uri": "s3://my-bucket/reports/2024/q1 report?.pdf"}')
    assert document.text is None and document.metadata == {}
    assert document.uri == S3Uri(bucket="my-bucket", key="reports/2024/q1 report?.pdf")  # "?" is part of a key
    assert document.uri.filename == "q1 report?.pdf"
    assert str(document.uri) == "s3://my-bucket/reports/2024/q1 report?.pdf"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("", "not valid JSON"),
        ("{'id': 'x'}", "not valid JSON"),
        (b'{"id": "\xff"}', "not UTF-8"),
        ("[1, 2]", "must be a JSON object, got an array"),
        ('{"text": "x"}', "id is missing"),
        ('{"id": 7, "text": "x"}', "id must be a string, got a number"),
        ('{"id": "  ", "text": "x"}', "id must not be empty"),
        ('{"id": "d"}', "exactly one of text and uri"),
        ('{"id": "d", "text": "x", "uri": "s3://bucket/key.txt"}', "exactly one of text and uri"),
        ('{"id": "d", "text": ["x"]}', "text must be a string, got an array"),
        ('{"id": "d", "uri": 5}', "uri must be a string, got a number"),
        ('{"id": "d", "text": "x", "metadata": "tag"}', "metadata must be a JSON object, got a string"),
        ('{"id": "d", "text": "x", "metadata": null}', "metadata must be a JSON object, got null"),
        ('{"id": "d", "txt": "x"}', "unknown fields ['txt']"),
        ('{"id": "d", "uri": "https://example.com/a.pdf"}', "must be an s3:// URI"),
        ('{"id": "d", "uri": "s3://bucket"}', "names a bucket but no object"),
        ('{"id": "d", "uri": "s3://bucket/"}', "names a bucket but no object"),
        ('{"id": "d", "uri": "s3://bucket/reports/"}', "names a folder"),
        ('{"id": "d", "uri": "s3://b/key.txt"}', "is not a bucket name"),
        ('{"id": "d", "uri": "s3://-bucket/key.txt"}', "is not a bucket name"),
    ],
)
def test_a_bad_line_is_a_document_error_saying_what_is_wrong(line: str | bytes, message: str) -> None:
    with pytest.raises(DocumentError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_document_line(line)


def test_a_uri_error_names_the_document() -> None:
    with pytest.raises(DocumentError, match=r"document 'doc-9': uri 's3://bucket' names a bucket"):
        parse_document_line('{"id": "doc-9", "uri": "s3://bucket"}')


def test_a_key_longer_than_s3_allows_is_rejected() -> None:
    with pytest.raises(DocumentError, match="longer than S3's 1024 bytes"):
        S3Uri.parse("s3://bucket/" + "é" * 513)  # 1026 bytes in UTF-8


# ---------------------------------------------------------------------------------------------------------
# Text and Markdown


def test_text_is_utf8_with_the_byte_order_mark_dropped() -> None:
    assert extract_text("notes.txt", "\ufeffCafé 東京 😀\r\nline two".encode()) == "Café 東京 😀\r\nline two"


def test_undecodable_text_is_a_document_error_with_the_offset() -> None:
    with pytest.raises(DocumentError, match=r"notes\.txt: not UTF-8 text \(byte 0xe9 at offset 3\)"):
        extract_text("notes.txt", "Café".encode("latin-1"))


def test_markdown_is_kept_as_written() -> None:
    assert extract_text("README.MD", MARKDOWN.encode()) == MARKDOWN  # the extension's case does not matter


@pytest.mark.parametrize("filename", ["report.docx", "archive.tar.gz", "Makefile", "page.html.bak"])
def test_an_unknown_extension_is_a_document_error(filename: str) -> None:
    with pytest.raises(DocumentError, match=rf"{filename}: unsupported file type .*supported: \.htm, \.html, \.md"):
        extract_text(filename, b"anything")


# ---------------------------------------------------------------------------------------------------------
# HTML


def test_html_keeps_the_main_text_and_its_headings_and_drops_the_boilerplate() -> None:
    text = extract_text("guide.html", ARTICLE_HTML.encode())
    assert text.startswith("# Chunking documents for retrieval\n")
    assert "\n## Choosing a chunk size\n" in text
    assert "the chunks closest to a question" in text
    assert "Café owners in Zürich" in text  # the page's charset honoured
    for boilerplate in ("Pricing", "Sign in", "Copyright", "Privacy policy"):
        assert boilerplate not in text


def test_html_honours_a_declared_legacy_charset() -> None:
    page = (
        "<html><head><meta charset='iso-8859-1'></head>"
        "<body><article><p>Crème brûlée à la carte.</p></article></body></html>"
    )
    assert "Crème brûlée" in extract_text("menu.htm", page.encode("iso-8859-1"))


@pytest.mark.parametrize(
    "page", [b"", b"<html><body></body></html>", b"<html><body><p>  </p><script>x = 1</script></body></html>"]
)
def test_html_without_main_text_is_a_document_error(page: bytes) -> None:
    with pytest.raises(DocumentError, match=r"empty\.html: no main text found"):
        extract_text("empty.html", page)


# ---------------------------------------------------------------------------------------------------------
# PDF


def test_the_hand_written_pdf_is_well_formed() -> None:
    reader = PdfReader(io.BytesIO(TWO_PAGE_PDF), strict=True)
    assert reader.pages[1].extract_text().strip() == "Outlook.\nWe expect further growth, e.g. in Europe."


def test_pdf_text_is_read_page_by_page_and_pages_are_joined_by_a_blank_line() -> None:
    assert extract_text("report.pdf", TWO_PAGE_PDF) == (
        "Quarterly report.\nRevenue grew by 12.5 percent.\n\nOutlook.\nWe expect further growth, e.g. in Europe."
    )


def test_a_pdf_with_an_empty_user_password_opens_by_itself() -> None:
    assert extract_text("report.pdf", _encrypted(TWO_PAGE_PDF, user_password="")).startswith("Quarterly report.")


def test_a_password_protected_pdf_is_a_document_error() -> None:
    with pytest.raises(DocumentError, match=r"report\.pdf: the PDF is protected by a password"):
        extract_text("report.pdf", _encrypted(TWO_PAGE_PDF, user_password="secret"))


@pytest.mark.parametrize("length", [0, 8, 100, len(TWO_PAGE_PDF) // 2, len(TWO_PAGE_PDF) - 40])
def test_a_truncated_pdf_is_a_document_error(length: int) -> None:
    with pytest.raises(DocumentError, match=r"report\.pdf: not a readable PDF"):
        extract_text("report.pdf", TWO_PAGE_PDF[:length])


def test_a_pdf_whose_structure_pypdf_chokes_on_is_a_document_error() -> None:
    trailer_as_a_name = TWO_PAGE_PDF.replace(b"trailer\n<<", b"trailer\n/Broken\n<<")  # pypdf: AttributeError
    with pytest.raises(DocumentError, match=r"report\.pdf: not a readable PDF \(damaged structure"):
        extract_text("report.pdf", trailer_as_a_name)


def test_not_a_pdf_at_all_is_a_document_error() -> None:
    with pytest.raises(DocumentError, match=r"scan\.pdf: not a readable PDF"):
        extract_text("scan.pdf", b"GIF89a this is an image")


def test_a_pdf_without_a_text_layer_is_a_document_error() -> None:
    with pytest.raises(DocumentError, match=r"scan\.pdf: the PDF has no text layer"):
        extract_text("scan.pdf", pdf_with_pages([[], []]))


def _encrypted(pdf: bytes, user_password: str) -> bytes:
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(pdf)))
    writer.encrypt(user_password=user_password, owner_password="owner")  # RC4: no cryptography package needed
    output = io.BytesIO()
    writer.write(output)
    return output.getvalue()
