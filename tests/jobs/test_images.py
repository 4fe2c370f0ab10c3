"""Images in batch lines, the request side (jobs/images): each spelling parsed, hostile images decoded within the
limits, https fetched through the SSRF guard from a real local TLS server, the prefetch's settling. No model needed;
the store's `s3://` images and the end-to-end runs are in test_run_kinds.py and test_cli_run.py."""

from __future__ import annotations

import base64
import io
import json
import ssl
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from jobs.formats.anthropic_messages import MESSAGES
from jobs.images.decode import decode_image
from jobs.images.inputs import ImageInputs, ImageLimits, ImageRef, ImageRejected
from jobs.images.prefetch import ImagePrefetch, settle_images
from jobs.images.sources import ImageSources
from jobs.openai_format.requests import CHAT_COMPLETIONS, RESPONSES, BatchRequest
from jobs.openai_format.validation import BatchLineValidator, LineError
from jobs.served_models import ModelNames, ServedModel, process_models
from jobs.webhooks.targets import AllowList
from tests.jobs.test_openai_format import SERVED, WordTokenizer
from tests.tls import self_signed_certificate

LIMITS = ImageLimits()
NOTHING_ALLOWED = AllowList(frozenset(), ())


def encoded(image: Image.Image, image_format: str, **options: Any) -> bytes:
    out = io.BytesIO()
    image.save(out, format=image_format, **options)
    return out.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


PNG = encoded(Image.new("RGB", (8, 6), (200, 10, 10)), "PNG")
NOISE = Image.frombytes("RGB", (64, 64), bytes(range(256)) * 48)


def rejection(data: bytes, limits: ImageLimits = LIMITS) -> ImageRejected:
    with pytest.raises(ImageRejected) as rejected:
        decode_image(data, limits)
    return rejected.value


# --- parsing: the three spellings ------------------------------------------------------------------------------------


def validate(url: str, body: dict[str, Any], limits: ImageLimits = LIMITS) -> BatchRequest | LineError:
    line = json.dumps({"custom_id": "img", "method": "POST", "url": url, "body": body})
    return BatchLineValidator(WordTokenizer(), 512, models=SERVED, image_limits=limits).validate(line)


def test_chat_image_parts_become_transformers_parts_and_refs_in_order() -> None:
    content = [
        {"type": "text", "text": "compare"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png", "detail": "low"}},
        {"type": "image_url", "image_url": {"url": data_url(PNG)}},
        {"type": "text", "text": "please"},
    ]
    request = validate(CHAT_COMPLETIONS, {"messages": [{"role": "developer", "content": "be brief"},
                                                       {"role": "user", "content": content}]})
    assert isinstance(request, BatchRequest) and request.images is not None
    assert request.images.refs == (ImageRef("https://example.com/a.png", "low"), ImageRef(data_url(PNG), "auto"))
    assert request.images.messages == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": [
            {"type": "text", "text": "compare"}, {"type": "image"}, {"type": "image"}, {"type": "text", "text": "please"},
        ]},
    ]
    # The prompt the line's checks count is its text alone: [system] be brief [user] compare\nplease [assistant]
    assert len(request.prompts[0]) == 7


def test_responses_input_image_and_anthropic_image_blocks_are_the_same_parts() -> None:
    responses = validate(RESPONSES, {"input": [{"role": "user", "content": [
        {"type": "input_text", "text": "what is it"},
        {"type": "input_image", "image_url": "s3://bucket/inbox/p/cat.png", "detail": "high"},
    ]}]})
    assert isinstance(responses, BatchRequest) and responses.images is not None
    assert responses.images.refs == (ImageRef("s3://bucket/inbox/p/cat.png", "high"),)
    assert responses.images.messages[-1]["content"] == [{"type": "text", "text": "what is it"}, {"type": "image"}]

    anthropic = validate(MESSAGES, {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": base64.b64encode(PNG).decode()}},
        {"type": "image", "source": {"type": "url", "url": "https://example.com/b.webp"}},
        {"type": "text", "text": "describe both"},
    ]}]})
    assert isinstance(anthropic, BatchRequest) and anthropic.images is not None
    assert [ref.url for ref in anthropic.images.refs] == [data_url(PNG), "https://example.com/b.webp"]
    assert anthropic.images.messages[-1]["content"] == [{"type": "image"}, {"type": "image"}, {"type": "text", "text": "describe both"}]


@pytest.mark.parametrize(
    ("url", "body", "code", "words"),
    [
        (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "http://example.com/a.png"}}]}]},
         "invalid_body", "an image URL must be a data: URL, an https:// URL or an s3:// URI"),
        (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png", "detail": "ultra"}}]}]},
         "invalid_body", "content[0].image_url.detail"),
        (CHAT_COMPLETIONS, {"messages": [{"role": "assistant", "content": [
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}]}]},
         "invalid_body", "only user messages carry images"),
        (CHAT_COMPLETIONS, {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://x.test/a.png"}}] * 3}]},
         "too_many_images", "the line has 3 images, over the limit of 2"),
        (RESPONSES, {"input": [{"role": "assistant", "content": [
            {"type": "input_image", "image_url": "https://x.test/a.png"}]}]},
         "invalid_body", "only user messages carry images"),
        (MESSAGES, {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/svg+xml", "data": "PHN2Zz4="}}]}]},
         "invalid_body", "media_type"),
        (MESSAGES, {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": [
            {"type": "document", "source": {}}]}]},
         "invalid_body", "document blocks are not supported"),
    ],
)
def test_image_parts_that_cannot_run_fail_their_line_at_validation(url: str, body: dict[str, Any], code: str, words: str) -> None:
    error = validate(url, body, ImageLimits(max_per_line=2))
    assert isinstance(error, LineError) and error.code == code and words in error.message, error


# --- decoding: formats and limits ---------------------------------------------------------------------------------------


def test_png_jpeg_webp_and_gif_decode_to_rgb() -> None:
    rgba = Image.new("RGBA", (5, 4), (0, 128, 255, 100))
    for data in (PNG, encoded(rgba.convert("RGB"), "JPEG"), encoded(rgba, "WEBP", lossless=True), encoded(rgba, "PNG")):
        image = decode_image(data, LIMITS)
        assert image.mode == "RGB" and image.size in ((8, 6), (5, 4))
    palette = Image.new("P", (3, 3))
    assert decode_image(encoded(palette, "PNG"), LIMITS).mode == "RGB"


def test_a_gif_is_read_as_its_first_frame() -> None:
    frames = [Image.new("RGB", (4, 4), color) for color in ((255, 0, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=100)
    image = decode_image(out.getvalue(), LIMITS)
    assert image.mode == "RGB" and image.getpixel((0, 0)) == (255, 0, 0)


def png_claiming(width: int, height: int) -> bytes:
    """A small PNG whose header claims `width` x `height`: a decompression bomb, as far as a decoder can tell."""
    signature, rest = PNG[:8], PNG[8:]
    length = struct.unpack(">I", rest[:4])[0]
    header = b"IHDR" + struct.pack(">II", width, height) + rest[16 : 8 + length]
    chunk = struct.pack(">I", length) + header + struct.pack(">I", zlib.crc32(header))
    return signature + chunk + rest[12 + length :]


@pytest.mark.parametrize(
    ("data", "code", "words"),
    [
        (png_claiming(100_000, 100_000), "image_too_large", "too large"),  # past Pillow's own bomb limit
        (png_claiming(6_000, 6_000), "image_too_large", "6000 x 6000 pixels, over the limit of 25000000"),
        (encoded(Image.new("L", (1, 100_000)), "PNG"), "image_too_large", "an aspect ratio of 100000"),
        (encoded(NOISE, "JPEG")[:896], "image_unreadable", "the JPEG image cannot be decoded: image file is truncated"),
        (encoded(NOISE, "PNG")[:91], "image_unreadable", "the PNG image cannot be decoded: image file is truncated"),
        (b"\x00\x01 these bytes are no image at all" * 20, "image_unreadable", "not an image"),
        (b'<?xml version="1.0"?><svg xmlns="http://www.w3.org/2000/svg" width="9" height="9"/>', "image_format_unsupported", "SVG"),
        (encoded(Image.new("RGB", (4, 4)), "BMP"), "image_format_unsupported", "BMP images are not supported"),
        (encoded(Image.new("RGB", (4, 4)), "TIFF"), "image_format_unsupported", "TIFF"),
    ],
    ids=["bomb", "over-pixels", "1x100000", "truncated-jpeg", "truncated-png", "garbage", "svg", "bmp", "tiff"],
)
def test_hostile_images_fail_with_their_own_code(data: bytes, code: str, words: str) -> None:
    rejected = rejection(data)
    assert rejected.code == code and words in rejected.message, rejected.message


def test_the_byte_limit_applies_to_data_urls_before_decoding() -> None:
    sources = ImageSources(ImageLimits(max_bytes=100), NOTHING_ALLOWED)
    with pytest.raises(ImageRejected, match="over the limit of 100 bytes") as too_large:
        sources.fetch(data_url(b"x" * 1000))
    assert too_large.value.code == "image_too_large"
    assert sources.fetch(data_url(PNG[:50])) == PNG[:50]
    for url, code in (
        ("data:image/svg+xml;base64,PHN2Zz4=", "image_format_unsupported"),
        ("data:text/plain;base64,aGk=", "image_format_unsupported"),
        ("data:image/png,rawtext", "image_fetch_failed"),
        ("data:image/png;base64,not*base64", "image_fetch_failed"),
        ("s3://bucket/inbox/p/a.png", "image_fetch_failed"),  # no store here (`conveyor run`)
    ):
        with pytest.raises(ImageRejected) as refused:
            sources.fetch(url)
        assert refused.value.code == code, (url, refused.value.message)


# --- https: a real TLS server on this machine --------------------------------------------------------------------------


class ImageServer(BaseHTTPRequestHandler):
    port = 0

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/cat.png":
            self._send(200, PNG)
        elif self.path == "/moved":
            self._send(302, b"", location="/cat.png")
        elif self.path == "/to-loopback":
            self._send(302, b"", location=f"https://127.0.0.1:{self.port}/cat.png")
        elif self.path == "/huge":  # no Content-Length: the body is cut off as it streams past the limit
            self.send_response(200)
            self.end_headers()
            for _ in range(100):
                self.wfile.write(b"\x89" * 10_000)
        elif self.path == "/slow.png":  # a byte now and then: each read is quick, the whole is not
            self.send_response(200)
            self.send_header("content-length", str(len(PNG)))
            self.end_headers()
            for byte in PNG:
                self.wfile.write(bytes([byte]))
                self.wfile.flush()
                time.sleep(0.1)
        else:
            self._send(404, b"no")

    def _send(self, status: int, body: bytes, location: str | None = None) -> None:
        self.send_response(status)
        self.send_header("content-length", str(len(body)))
        if location is not None:
            self.send_header("location", location)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


class QuietServer(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        pass  # clients that hang up (refused certificates, abandoned bodies) are what these tests do


@pytest.fixture(scope="module")
def https_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, ssl.SSLContext]]:
    """A TLS server for `localhost`, and a client context that trusts its self-signed certificate."""
    certificate, key = self_signed_certificate(
        tmp_path_factory.mktemp("tls"), "localhost", "DNS:localhost,IP:127.0.0.1"
    )
    server = QuietServer(("127.0.0.1", 0), ImageServer)
    server.daemon_threads = True
    ImageServer.port = server.server_address[1]
    serving = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    serving.load_cert_chain(certificate, key)
    server.socket = serving.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"https://localhost:{ImageServer.port}", ssl.create_default_context(cafile=str(certificate))
    server.shutdown()
    server.server_close()


def https_sources(tls: ssl.SSLContext, allowed: str = "localhost", **limits: Any) -> ImageSources:
    """The guard's allow-list names `localhost` (as an operator would an internal host): only that name is let through,
    not the loopback address itself."""
    return ImageSources(ImageLimits(fetch_timeout_seconds=1.0, **limits), AllowList.parse(allowed), tls=tls)


def test_https_images_are_fetched_and_redirects_followed(https_server: tuple[str, ssl.SSLContext]) -> None:
    base, tls = https_server
    sources = https_sources(tls)
    assert sources.fetch(f"{base}/cat.png") == PNG
    assert sources.fetch(f"{base}/moved") == PNG


@pytest.mark.parametrize(
    ("path", "allowed", "code", "words"),
    [
        ("/cat.png", "", "image_fetch_failed", "resolves to 127.0.0.1, a loopback address"),
        ("/to-loopback", "localhost", "image_fetch_failed", "images cannot be fetched from 127.0.0.1: a loopback address"),
        ("/huge", "localhost", "image_too_large", "over the limit of 50000 bytes"),
        ("/slow.png", "localhost", "image_fetch_failed", "no answer within 1 s"),
        ("/absent.png", "localhost", "image_fetch_failed", "HTTP 404"),
    ],
    ids=["private-host", "redirect-to-127.0.0.1", "oversize", "slow-server", "not-found"],
)
def test_https_fetches_that_must_fail(
    https_server: tuple[str, ssl.SSLContext], path: str, allowed: str, code: str, words: str
) -> None:
    base, tls = https_server
    started = time.monotonic()
    with pytest.raises(ImageRejected) as refused:
        https_sources(tls, allowed, max_bytes=50_000).fetch(base + path)
    assert refused.value.code == code and words in refused.value.message, refused.value.message
    assert time.monotonic() - started < 3  # the time limit (1 s) holds, whatever the server does


def test_the_system_trust_store_refuses_a_self_signed_server(https_server: tuple[str, ssl.SSLContext]) -> None:
    base, _ = https_server
    with pytest.raises(ImageRejected, match="CERTIFICATE_VERIFY_FAILED"):
        ImageSources(LIMITS, AllowList.parse("localhost")).fetch(f"{base}/cat.png")


# --- a line's images, prefetched and settled ------------------------------------------------------------------------


def test_a_slow_image_costs_its_own_line_only(https_server: tuple[str, ssl.SSLContext]) -> None:
    base, tls = https_server
    slow = ImageInputs([], (ImageRef(f"{base}/slow.png"),), {})
    fine = ImageInputs([{"role": "user", "content": [{"type": "image"}]}], (ImageRef(data_url(PNG), "low"),), {})
    multimodal = ModelNames([ServedModel("vlm", ("vlm",), "generation", 0, accepts_images=True)], {})
    with ImagePrefetch(https_sources(tls)) as prefetch:
        started = time.monotonic()
        pending_slow, pending_fine = prefetch.submit(slow), prefetch.submit(fine)
        settled = settle_images("fine", pending_fine, "vlm", multimodal)
        assert time.monotonic() - started < 0.5  # not behind the slow one
        assert not isinstance(settled, LineError)
        assert settled.details == ["low"] and settled.images[0].size == (8, 6) and settled.messages == fine.messages
        failed = settle_images("slow", pending_slow, "vlm", multimodal)
    assert isinstance(failed, LineError) and failed.code == "image_fetch_failed"


def test_an_image_for_a_text_only_model_is_read_then_refused() -> None:
    text_only = ModelNames(process_models(["smollm2"], "all-minilm-l6-v2"), {})
    with ImagePrefetch(ImageSources(LIMITS, NOTHING_ALLOWED)) as prefetch:
        good = settle_images("a", prefetch.submit(ImageInputs([], (ImageRef(data_url(PNG)),), {})), "smollm2", text_only)
        bomb = ImageInputs([], (ImageRef(data_url(PNG)), ImageRef(data_url(png_claiming(9000, 9000)))), {})
        bad = settle_images("b", prefetch.submit(bomb), "smollm2", text_only)
    assert isinstance(good, LineError) and good.code == "model_not_multimodal"
    assert "'smollm2' reads text only" in good.message
    assert isinstance(bad, LineError) and bad.code == "image_too_large"  # the image's own code comes first
