"""An image's bytes, from where its line says: a data URL, an https URL, or an object in the project's own store.

- `data:image/<type>;base64,<data>`: decoded here; a media type other than an image (or SVG) is refused.
- `https://`: fetched with the webhook's SSRF guard (`jobs.webhooks.targets`): the host must resolve to public
  addresses only (unless `CONVEYOR_IMAGE_ALLOWED_HOSTS` names it), the connection goes to the very address that was
  checked, each redirect (at most `MAX_REDIRECTS`) is checked again like the first URL, the body is read in pieces
  and abandoned past the byte limit, and the whole fetch, redirects included, ends at the time limit: a slow server
  costs its own line, never more than `fetch_timeout_seconds`.
- `s3://bucket/key`: read from the deployment's store only inside the project's inbox (`inbox/<project>/`), with
  the checks a RAG document's URI has (`jobs.rag.kind.inbox_object_key`): another project's objects, or anything
  else in the bucket, are refused.

Every failure is an `ImageRejected` that fails the image's line alone (`image_fetch_failed`, `image_too_large`,
`image_format_unsupported`).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import ssl
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urljoin

from jobs.images.inputs import ImageLimits, ImageRejected
from jobs.rag.documents import DocumentError, S3Uri
from jobs.rag.kind import inbox_object_key
from jobs.storage import ObjectStore
from jobs.webhooks.targets import AllowList, PinnedConnection, TargetUse, WebhookTarget, WebhookTargetRefused, resolve_target

MAX_REDIRECTS = 3
READ_PIECE_BYTES = 64 * 1024
IMAGE_USE = TargetUse("images cannot be fetched from", "CONVEYOR_IMAGE_ALLOWED_HOSTS")
USER_AGENT = "conveyor-image-fetch"

Resolver = Callable[[str, AllowList, TargetUse], WebhookTarget]


@dataclass(frozen=True)
class ProjectStore:
    """A project's view of the deployment's store, for `s3://` images: its inbox and nothing else."""

    store: ObjectStore
    project_id: str


class ImageSources:
    """Fetches images' bytes for one project. Thread-safe: a chunk's prefetch threads share one."""

    def __init__(
        self,
        limits: ImageLimits,
        allow_list: AllowList,
        project: ProjectStore | None = None,
        *,
        tls: ssl.SSLContext | None = None,  # None: the system's trusted certificates
        resolve: Resolver = resolve_target,
    ) -> None:
        """project: where `s3://` images are read; None (`conveyor run`, which has no store): they are refused."""
        self.limits = limits
        self._allow_list = allow_list
        self._project = project
        self._tls = tls
        self._resolve = resolve

    def fetch(self, url: str) -> bytes:
        if url.startswith("data:"):
            return self._data_url(url)
        if url.startswith("https://"):
            return self._https(url)
        if url.startswith("s3://"):
            return self._s3(url)
        raise ImageRejected("image_fetch_failed", "an image URL must be a data: URL, an https:// URL or an s3:// URI")

    def _data_url(self, url: str) -> bytes:
        header, comma, payload = url.partition(",")
        media_type, _, encoding = header.removeprefix("data:").partition(";")
        if not comma or encoding != "base64":
            raise ImageRejected("image_fetch_failed", "a data URL image must be data:image/<type>;base64,<data>")
        if not media_type.startswith("image/") or media_type == "image/svg+xml":
            raise ImageRejected(
                "image_format_unsupported", f"data URL of type {media_type or '(none)'!r}; send PNG, JPEG, WebP or GIF"
            )
        if len(payload) * 3 // 4 > self.limits.max_bytes + 3:  # judged before decoding, which would hold it all
            raise ImageRejected(
                "image_too_large", f"the data URL's image is over the limit of {self.limits.max_bytes} bytes"
            )
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError) as invalid:
            raise ImageRejected("image_fetch_failed", f"the data URL is not valid base64: {invalid}") from None

    def _https(self, url: str) -> bytes:
        deadline = time.monotonic() + self.limits.fetch_timeout_seconds
        for _ in range(MAX_REDIRECTS + 1):
            try:
                target = self._resolve(url, self._allow_list, IMAGE_USE)
            except WebhookTargetRefused as refused:
                raise ImageRejected("image_fetch_failed", str(refused)) from None
            try:
                location = self._get(target, deadline)
            except (OSError, http.client.HTTPException) as failed:
                timed_out = time.monotonic() >= deadline or isinstance(failed, TimeoutError)
                reason = f"no answer within {self.limits.fetch_timeout_seconds:g} s" if timed_out else repr(failed)
                raise ImageRejected("image_fetch_failed", f"fetching {_shown(url)} failed: {reason}") from None
            if isinstance(location, bytes):
                return location
            url = urljoin(url, location)
            if not url.startswith("https://"):
                raise ImageRejected("image_fetch_failed", f"a redirect to {_shown(url)}: only https is followed")
        raise ImageRejected("image_fetch_failed", f"more than {MAX_REDIRECTS} redirects")

    def _get(self, target: WebhookTarget, deadline: float) -> bytes | str:
        """The body of a 200, or a redirect's Location."""
        connection = PinnedConnection(target, _left(deadline), self._tls)
        try:
            connection.request("GET", target.url.path, headers={"user-agent": USER_AGENT, "accept": "image/*"})
            response = connection.getresponse()
            if response.status in (301, 302, 303, 307, 308):
                location = response.getheader("location")
                if not location:
                    raise ImageRejected("image_fetch_failed", f"a {response.status} redirect without a Location")
                return location
            if response.status != 200:
                raise ImageRejected("image_fetch_failed", f"the image URL answered HTTP {response.status}")
            declared = response.getheader("content-length")
            if declared is not None and declared.isdigit() and int(declared) > self.limits.max_bytes:
                raise ImageRejected(
                    "image_too_large", f"the image is {declared} bytes, over the limit of {self.limits.max_bytes}"
                )
            return self._body(connection, response, deadline)
        finally:
            connection.close()

    def _body(self, connection: PinnedConnection, response: http.client.HTTPResponse, deadline: float) -> bytes:
        body = bytearray()
        while True:
            if connection.sock is not None:  # each read waits at most what is left of the whole fetch
                connection.sock.settimeout(_left(deadline))
            piece = response.read1(READ_PIECE_BYTES)
            if not piece:
                return bytes(body)
            body += piece
            if len(body) > self.limits.max_bytes:
                raise ImageRejected("image_too_large", f"the image is over the limit of {self.limits.max_bytes} bytes")
            if time.monotonic() >= deadline:
                raise TimeoutError("the time limit ended while the body was read")

    def _s3(self, url: str) -> bytes:
        if self._project is None:
            raise ImageRejected("image_fetch_failed", "s3:// images are read from the service's store; here there is none")
        project = self._project
        try:
            key = inbox_object_key(S3Uri.parse(url), project.store.settings, project.project_id)
        except DocumentError as refused:
            raise ImageRejected("image_fetch_failed", str(refused).replace("uri ", "", 1)) from None
        info = project.store.head(key)
        if info is None:
            raise ImageRejected("image_fetch_failed", f"no object at {url}")
        if info.size > self.limits.max_bytes:
            raise ImageRejected(
                "image_too_large", f"the image is {info.size} bytes, over the limit of {self.limits.max_bytes}"
            )
        return project.store.read_bytes(key)


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the time limit ended")
    return left


def _shown(url: str) -> str:
    return url if len(url) <= 120 else url[:117] + "..."
