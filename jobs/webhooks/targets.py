"""Where a webhook may be sent, and how to reach it without being turned against our own network (SSRF).

A URL is checked when it is registered and again at every send, after DNS resolution: a destination that
resolves to a loopback, private, link-local, unspecified, multicast, reserved or cloud metadata address is
refused unless the allow-list (`CONVEYOR_WEBHOOK_ALLOWED_HOSTS`) names its host or covers its address. The
POST then connects to the very address that was checked, so a DNS answer that changes between the check and
the connection (DNS rebinding) cannot redirect it; the request keeps the URL's Host header, and https still
verifies the certificate against the URL's hostname. Redirects are never followed.
"""

from __future__ import annotations

import http.client
import ipaddress
import socket
import ssl
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

SEND_TIMEOUT_SECONDS = 10.0
MAX_URL_CHARS = 2048  # the endpoints table's url column
CLOUD_METADATA_ADDRESSES = frozenset(
    {ipaddress.ip_address("169.254.169.254"), ipaddress.ip_address("fd00:ec2::254")}
)
NAT64_PREFIX = ipaddress.ip_network("64:ff9b::/96")


class WebhookTargetRefused(Exception):
    """The URL may not receive webhooks; the message says why, in words a client can act on."""


@dataclass(frozen=True)
class AllowList:
    """Hosts (exact names) and networks that may receive webhooks although they are not public."""

    hostnames: frozenset[str]
    networks: tuple[IpNetwork, ...]

    @classmethod
    def parse(cls, raw: str) -> "AllowList":
        """Comma-separated hostnames, IP addresses and CIDR networks, e.g. "hooks.internal,10.1.0.0/16,::1"."""
        hostnames: set[str] = set()
        networks: list[IpNetwork] = []
        for entry in (part.strip().lower() for part in raw.split(",")):
            if not entry:
                continue
            try:
                networks.append(ipaddress.ip_network(entry.strip("[]"), strict=False))
            except ValueError:
                if "/" in entry:
                    raise ValueError(f"CONVEYOR_WEBHOOK_ALLOWED_HOSTS: {entry!r} is not a valid network") from None
                hostnames.add(entry)
        return cls(frozenset(hostnames), tuple(networks))

    def permits(self, hostname: str, address: IpAddress) -> bool:
        return hostname.lower() in self.hostnames or any(address in network for network in self.networks)


@dataclass(frozen=True)
class WebhookUrl:
    """A URL's parts, as the POST needs them."""

    scheme: str
    hostname: str
    port: int
    path: str  # with the query, if any


@dataclass(frozen=True)
class WebhookTarget:
    url: WebhookUrl
    address: IpAddress  # the checked address the POST connects to


@dataclass(frozen=True)
class HttpAnswer:
    status_code: int
    location: str | None  # a redirect's destination, reported but never followed


def parse_webhook_url(url: str) -> WebhookUrl:
    if len(url) > MAX_URL_CHARS:
        raise WebhookTargetRefused(f"the URL is longer than {MAX_URL_CHARS} characters")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as invalid:
        raise WebhookTargetRefused(f"{url!r} is not a valid URL: {invalid}") from None
    if parts.scheme not in ("http", "https"):
        raise WebhookTargetRefused(f"only http and https URLs can receive webhooks, not {parts.scheme or 'no'} scheme")
    if not parts.hostname:
        raise WebhookTargetRefused(f"{url!r} names no host")
    if parts.username is not None or parts.password is not None:
        raise WebhookTargetRefused("the URL may not hold credentials; verify the webhook signature instead")
    path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
    default_port = 443 if parts.scheme == "https" else 80
    return WebhookUrl(scheme=parts.scheme, hostname=parts.hostname, port=port or default_port, path=path)


def why_forbidden(address: IpAddress) -> str | None:
    """Why this address may not receive webhooks, or None for a public one."""
    if address in CLOUD_METADATA_ADDRESSES:
        return "a cloud metadata address"
    embedded = _embedded_ipv4(address)
    if embedded is not None:
        reason = why_forbidden(embedded)
        return None if reason is None else f"{reason} ({embedded}, embedded in an IPv6 address)"
    checks = (
        (address.is_unspecified, "an unspecified address"),
        (address.is_loopback, "a loopback address"),
        (address.is_link_local, "a link-local address"),
        (address.is_multicast, "a multicast address"),
        (address.is_reserved, "a reserved address"),
        (address.is_private, "a private address"),
        (not address.is_global, "not a public address"),
    )
    return next((reason for applies, reason in checks if applies), None)


@dataclass(frozen=True)
class TargetUse:
    """What a checked URL is for, in the words of a refusal: the guard serves webhooks and image fetches alike."""

    refused: str  # "webhooks cannot be sent to"
    allow_setting: str  # the allow-list variable an operator may set


WEBHOOK_USE = TargetUse("webhooks cannot be sent to", "CONVEYOR_WEBHOOK_ALLOWED_HOSTS")


def resolve_target(url: str, allow_list: AllowList, use: TargetUse = WEBHOOK_USE) -> WebhookTarget:
    """The address to send `url` to: every address its host resolves to must be permitted, since a client
    could otherwise mix a public and a private answer and hope for the private one."""
    parts = parse_webhook_url(url)
    addresses = _resolve(parts.hostname, parts.port)
    for address in addresses:
        reason = why_forbidden(address)
        if reason is not None and not allow_list.permits(parts.hostname, address):
            problem = reason if _is_address(parts.hostname) else f"it resolves to {address}, {reason}"
            raise WebhookTargetRefused(
                f"{use.refused} {parts.hostname}: {problem} (an operator can allow it with {use.allow_setting})"
            )
    return WebhookTarget(url=parts, address=addresses[0])


def post_to_target(
    target: WebhookTarget, body: bytes, headers: Mapping[str, str], timeout_s: float = SEND_TIMEOUT_SECONDS
) -> HttpAnswer:
    """POST `body` to the checked address; raises OSError (timeouts, refused connections, TLS failures).
    The answer's body is never read: its status is all that counts, and a slow body cannot hold us."""
    connection = PinnedConnection(target, timeout_s)
    try:
        connection.request("POST", target.url.path, body=body, headers=dict(headers))
        response = connection.getresponse()
        return HttpAnswer(status_code=response.status, location=response.getheader("location"))
    except http.client.HTTPException as garbled:  # not HTTP at all, or cut off mid-answer
        raise OSError(f"invalid HTTP response: {garbled!r}") from None
    finally:
        connection.close()


class PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to `target.address` whatever DNS says now; Host and TLS name stay the URL's. `tls`: the
    context https verifies with (None: the system's trusted certificates); image fetches use it too."""

    def __init__(self, target: WebhookTarget, timeout_s: float, tls: ssl.SSLContext | None = None) -> None:
        super().__init__(target.url.hostname, target.url.port, timeout=timeout_s)
        self._address = target.address
        self._tls = (tls or ssl.create_default_context()) if target.url.scheme == "https" else None
        if self._tls is not None:
            self.default_port = 443  # a Host header without ":443", as any https client sends it

    def connect(self) -> None:
        raw = socket.create_connection((str(self._address), self.port), self.timeout)
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = raw if self._tls is None else self._tls.wrap_socket(raw, server_hostname=self.host)


def _resolve(hostname: str, port: int) -> list[IpAddress]:
    try:
        answers = socket.getaddrinfo(hostname.strip("[]"), port, type=socket.SOCK_STREAM)
    except socket.gaierror as failure:
        raise WebhookTargetRefused(f"the host {hostname} does not resolve: {failure.strerror}") from None
    return _unique(ipaddress.ip_address(str(answer[4][0]).split("%")[0]) for answer in answers)


def _is_address(hostname: str) -> bool:
    try:
        ipaddress.ip_address(hostname)
    except ValueError:
        return False
    return True


def _unique(addresses: Iterable[IpAddress]) -> list[IpAddress]:
    return list(dict.fromkeys(addresses))


def _embedded_ipv4(address: IpAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one carries (mapped, 6to4, NAT64), which is where packets may end up."""
    if not isinstance(address, ipaddress.IPv6Address):
        return None
    if address.ipv4_mapped is not None:
        return address.ipv4_mapped
    if address.sixtofour is not None:
        return address.sixtofour
    if address in NAT64_PREFIX:
        return ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
    return None
