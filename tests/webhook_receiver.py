"""A real HTTP server on 127.0.0.1 that receives webhooks: it answers with a scripted list of statuses and keeps
every request it got, for tests to verify with the `openai` SDK."""

from __future__ import annotations

import ssl
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path


@dataclass(frozen=True)
class ReceivedRequest:
    path: str
    headers: dict[str, str]
    body: bytes


@dataclass
class WebhookReceiver:
    """Answers the n-th request with statuses[n] (the last one once the list runs out)."""

    statuses: list[int] = field(default_factory=lambda: [200])
    delay_s: float = 0.0  # before answering: lets tests overlap two senders
    location: str | None = None  # sent with 3xx answers
    received: list[ReceivedRequest] = field(default_factory=list)
    url: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def answer_for(self, request: ReceivedRequest) -> int:
        with self._lock:
            self.received.append(request)
            return self.statuses[min(len(self.received), len(self.statuses)) - 1]

    def wait_for(self, count: int, timeout_s: float) -> list[ReceivedRequest]:
        deadline = time.monotonic() + timeout_s
        while len(self.received) < count:
            assert time.monotonic() < deadline, f"{len(self.received)} requests after {timeout_s} s, wanted {count}"
            time.sleep(0.1)
        return list(self.received)


@contextmanager
def running_receiver(
    receiver: WebhookReceiver, tls_files: tuple[Path, Path] | None = None
) -> Iterator[WebhookReceiver]:
    """Serves `receiver` on a free port of 127.0.0.1 (https with tls_files = (certificate, key))."""

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's naming
            body = self.rfile.read(int(self.headers.get("content-length") or 0))
            request = ReceivedRequest(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
            status = receiver.answer_for(request)
            time.sleep(receiver.delay_s)
            self.send_response(status)
            if receiver.location is not None and 300 <= status < 400:
                self.send_header("location", receiver.location)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet test output
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    scheme = "http"
    if tls_files is not None:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(*tls_files)
        server.socket = context.wrap_socket(server.socket, server_side=True)
        scheme = "https"
    receiver.url = f"{scheme}://127.0.0.1:{server.server_address[1]}/hooks/conveyor"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver
    finally:
        server.shutdown()
        server.server_close()
