"""The SSRF guard and Standard Webhooks signing, without a stack: classification, allow-list, pinned connections,
certificate checks, and signatures the `openai` SDK accepts."""

from __future__ import annotations

import ipaddress
import json
import ssl
import time
from pathlib import Path

import openai
import pytest

from jobs.webhooks.signing import new_signing_secret, signed_headers
from jobs.webhooks.targets import (
    AllowList,
    WebhookTarget,
    WebhookTargetRefused,
    WebhookUrl,
    parse_webhook_url,
    post_to_target,
    resolve_target,
    why_forbidden,
)
from tests.tls import self_signed_certificate
from tests.webhook_receiver import WebhookReceiver, running_receiver

NOTHING_ALLOWED = AllowList.parse("")


@pytest.mark.parametrize(
    ("address", "reason"),
    [
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("10.2.3.4", "private"),
        ("172.16.0.9", "private"),
        ("192.168.1.1", "private"),
        ("fd12::1", "private"),
        ("169.254.169.254", "cloud metadata"),
        ("fd00:ec2::254", "cloud metadata"),
        ("169.254.10.10", "link-local"),
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("ff02::1", "multicast"),
        ("240.0.0.1", "reserved"),
        ("100.64.0.1", "not a public address"),
        ("::ffff:127.0.0.1", "loopback"),  # IPv4-mapped
        ("2002:a00:1::1", "private"),  # 6to4 of 10.0.0.1
        ("64:ff9b::a9fe:a9fe", "cloud metadata"),  # NAT64 of 169.254.169.254
    ],
)
def test_non_public_addresses_are_refused_with_their_reason(address: str, reason: str) -> None:
    assert reason in (why_forbidden(ipaddress.ip_address(address)) or "")


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888"])
def test_public_addresses_pass(address: str) -> None:
    assert why_forbidden(ipaddress.ip_address(address)) is None


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://127.0.0.1:9000/hook", "loopback"),
        ("http://localhost:9000/hook", "resolves to"),  # a name, refused for the address it resolves to
        ("http://10.0.0.7/hook", "private"),
        ("http://169.254.169.254/latest/meta-data", "cloud metadata"),
        ("http://[fd00:ec2::254]/", "cloud metadata"),
        ("http://0x7f.1/", "loopback"),  # inet_aton's spelling of 127.0.0.1
        ("ftp://example.com/", "only http and https"),
        ("file:///etc/passwd", "only http and https"),
        ("http://user:secret@example.com/", "credentials"),
        ("http:///no-host", "names no host"),
        ("http://host.invalid/", "does not resolve"),
    ],
)
def test_refused_urls(url: str, message: str) -> None:
    with pytest.raises(WebhookTargetRefused, match=message):
        resolve_target(url, NOTHING_ALLOWED)


def test_the_allow_list_admits_hosts_addresses_and_networks() -> None:
    allowed = AllowList.parse(" localhost , 10.0.0.0/8,[::1]")
    assert resolve_target("http://localhost:8080/x?y=1", allowed).url == WebhookUrl("http", "localhost", 8080, "/x?y=1")
    assert str(resolve_target("http://10.9.8.7/", allowed).address) == "10.9.8.7"
    assert str(resolve_target("https://[::1]/", allowed).address) == "::1"
    with pytest.raises(WebhookTargetRefused, match="private"):
        resolve_target("http://192.168.0.1/", allowed)
    with pytest.raises(WebhookTargetRefused, match="loopback"):
        resolve_target("http://127.0.0.1/", allowed)  # only the name localhost was allowed, not its address
    with pytest.raises(ValueError, match="not a valid network"):
        AllowList.parse("10.0.0.0/33")


def test_default_ports_and_paths() -> None:
    assert parse_webhook_url("https://hooks.example.com") == WebhookUrl("https", "hooks.example.com", 443, "/")
    parsed = parse_webhook_url("http://Hooks.Example.com/a/b?c=d")
    assert parsed == WebhookUrl("http", "hooks.example.com", 80, "/a/b?c=d")


def test_the_post_goes_to_the_checked_address_with_the_urls_host_header() -> None:
    """DNS rebinding: whatever the name resolves to now, the connection goes to the address that was checked."""
    with running_receiver(WebhookReceiver(statuses=[204])) as receiver:
        port = int(receiver.url.split(":")[2].split("/")[0])
        target = WebhookTarget(WebhookUrl("http", "hooks.example.test", port, "/in"), ipaddress.ip_address("127.0.0.1"))
        answer = post_to_target(target, b"{}", {"content-type": "application/json"})
    assert answer.status_code == 204
    (request,) = receiver.received
    assert request.path == "/in" and request.headers["host"] == f"hooks.example.test:{port}"


def test_https_verifies_the_certificate(tmp_path: Path) -> None:
    certificate, key = self_signed_certificate(tmp_path, "127.0.0.1", "IP:127.0.0.1")
    with running_receiver(WebhookReceiver(), tls_files=(certificate, key)) as receiver:
        target = resolve_target(receiver.url, AllowList.parse("127.0.0.1"))
        with pytest.raises(ssl.SSLCertVerificationError):  # self-signed: nobody vouches for it
            post_to_target(target, b"{}", {})
    assert receiver.received == []


def test_signatures_verify_with_the_openai_sdk() -> None:
    secret = new_signing_secret()
    assert secret.startswith("whsec_")
    body = json.dumps(
        {"id": "evt_1", "object": "event", "type": "batch.completed", "created_at": 1, "data": {"id": "batch_1"}}
    ).encode()
    headers = signed_headers(secret, "evt_1", int(time.time()), body)
    client = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9")
    event = client.webhooks.unwrap(body, headers, secret=secret)
    assert event.type == "batch.completed" and event.data.id == "batch_1"
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body.replace(b"batch_1", b"batch_2"), headers, secret=secret)
    with pytest.raises(openai.InvalidWebhookSignatureError):
        client.webhooks.unwrap(body, headers, secret=new_signing_secret())
