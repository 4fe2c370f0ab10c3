"""Console sign-in: an API key exchanged for an opaque session cookie, and the CSRF token of each session.

The cookie holds a random token only (HttpOnly, SameSite=Strict, Secure when served over https). Redis keeps, under
the token's hash, the hash of the key it was opened with and the session's CSRF token, for SESSION_SECONDS. Each
request resolves that key hash through the API's own `KeyCache`, so a session sees exactly the project its key
sees over REST, and a revoked key ends its sessions at once. Every state-changing form carries the CSRF token,
compared in constant time.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import secrets
from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Form, Request
from redis import Redis
from starlette.concurrency import run_in_threadpool

from api.auth import KeyCache
from jobs.keys import hash_key

COOKIE_NAME = "conveyor_console"
SESSION_SECONDS = 8 * 3600  # a session's lifetime from sign-in, in seconds


class SignInNeeded(Exception):
    """No session, an expired one, or one whose key was revoked."""


class CsrfRefused(Exception):
    """A state-changing form without the session's CSRF token."""


@dataclass(frozen=True)
class Session:
    key_hash: str
    csrf_token: str


@dataclass(frozen=True)
class Viewer:
    """Who is looking: the project of the session's key, and the token its forms must carry."""

    project_id: str
    csrf_token: str


class ConsoleSessions:
    def __init__(self, redis: Redis, prefix: str) -> None:
        self._redis = redis
        self._prefix = prefix

    def _key(self, token: str) -> str:
        return f"{self._prefix}console_session:{hashlib.sha256(token.encode()).hexdigest()}"

    def open(self, api_key: str) -> str:
        """A new session for `api_key` (already checked); returns the cookie's token."""
        token = secrets.token_urlsafe(32)
        session = {"key_hash": hash_key(api_key), "csrf_token": secrets.token_urlsafe(32)}
        self._redis.set(self._key(token), json.dumps(session), ex=SESSION_SECONDS)
        return token

    def read(self, token: str) -> Session | None:
        raw = self._redis.get(self._key(token))
        return None if raw is None else Session(**json.loads(raw))

    def close(self, token: str) -> None:
        self._redis.delete(self._key(token))


async def current_viewer(request: Request) -> Viewer:
    token = request.cookies.get(COOKIE_NAME)
    sessions: ConsoleSessions = request.app.state.console_sessions
    session = await run_in_threadpool(sessions.read, token) if token else None
    if session is None:
        raise SignInNeeded()
    keys: KeyCache = request.app.state.keys
    project_id = await keys.project_for_hash(session.key_hash)
    if project_id is None:  # the key was revoked since sign-in
        raise SignInNeeded()
    return Viewer(project_id, session.csrf_token)


ViewerDep = Annotated[Viewer, Depends(current_viewer)]


async def checked_form(viewer: ViewerDep, csrf_token: Annotated[str, Form()] = "") -> Viewer:
    """The viewer of a state-changing form, once its CSRF token matches the session's."""
    if not hmac.compare_digest(csrf_token.encode(), viewer.csrf_token.encode()):
        raise CsrfRefused()
    return viewer


FormViewerDep = Annotated[Viewer, Depends(checked_form)]
