"""Standard Webhooks signatures (https://www.standardwebhooks.com), the scheme OpenAI's webhooks use.

The secret is "whsec_" + base64 of random bytes; the key is those bytes. A message carries
`webhook-id`, `webhook-timestamp` (unix seconds) and `webhook-signature: v1,<base64 HMAC-SHA256 of
"{id}.{timestamp}.{body}">`, which is what `openai.OpenAI().webhooks.unwrap(body, headers, secret=...)` checks.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import secrets

SECRET_PREFIX = "whsec_"
SECRET_BYTES = 24  # what Standard Webhooks' own libraries generate


def new_signing_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(SECRET_BYTES)).decode()


def signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    key = base64.b64decode(secret.removeprefix(SECRET_PREFIX))
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(key, signed, hashlib.sha256).digest()).decode()


def signed_headers(secret: str, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": signature(secret, message_id, timestamp, body),
    }


def secret_hint(secret: str) -> str:
    """Enough of the secret to tell two apart in a listing, too little to sign with."""
    return secret[: len(SECRET_PREFIX) + 4] + "…"
