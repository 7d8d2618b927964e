"""ASGI middleware, outermost first: request context -> auth -> body limits -> the app.

* :class:`RequestContextMiddleware` gives every request an id (``x-request-id`` on every
  response, ``request_id`` in error bodies, in the logs), checks the ``Host`` header when
  ``allowed_hosts`` is set (DNS rebinding), answers 503 while the server drains for a shutdown
  (:mod:`paxcache.server.shutdown`), and turns any exception that escapes the app into a
  logged 500 without details.
* :class:`AuthMiddleware`: with API keys, every route but ``/health`` needs
  ``Authorization: Bearer KEY`` (``/metrics``, ``/docs`` and ``/openapi.json`` too), checked
  *before* the body is read. It records the caller's tenant in the request state.
* :class:`BodyLimitMiddleware` reads the body within ``max_body_bytes`` (413) and
  ``body_timeout_s`` (408) before the app sees it.

They answer their refusals themselves (:func:`send_error`), with the same OpenAI-shaped body
as the app's errors. The threat model is in SECURITY.md.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI

from paxcache.server.protocol import APIError, ServerLimits, internal_error

__all__ = [
    "AuthMiddleware",
    "BodyLimitMiddleware",
    "RequestContextMiddleware",
    "install_middleware",
    "request_id",
    "send_error",
]

logger = logging.getLogger(__name__)


def _scope_state(scope: dict) -> dict:
    return scope.setdefault("state", {})


def request_id(scope_or_request: Any) -> str | None:
    """The id :class:`RequestContextMiddleware` gave a request (scope or ``Request``)."""
    scope = getattr(scope_or_request, "scope", scope_or_request)
    return scope.get("state", {}).get("request_id")


def _header(scope: dict, name: bytes) -> bytes | None:
    value = None
    for k, v in scope.get("headers", ()):
        if k == name:
            value = v
    return value


async def send_error(
    send: Any, scope: dict, err: APIError, extra_headers: Sequence[tuple[bytes, bytes]] = ()
) -> None:
    """Answers ``err`` directly from middleware (no request body is read)."""
    body = json.dumps(err.body(request_id(scope)), ensure_ascii=True).encode("ascii")
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    if err.status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    headers.extend(extra_headers)
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestContextMiddleware:
    """Request ids, the ``Host`` check, the shutdown drain, and a logged 500 for anything that
    escapes the app.

    Args:
      app: the ASGI app.
      allowed_hosts: the ``Host`` values accepted (None: any).
      gate: the shutdown state (a :class:`paxcache.server.shutdown.ShutdownGate`: its
        ``refuses(path)`` and ``refusal()``; ``active`` counts the requests being handled).
    """

    def __init__(self, app: Any, allowed_hosts: frozenset[str] | None, gate: Any = None) -> None:
        self.app = app
        self.allowed_hosts = allowed_hosts
        self.gate = gate

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = f"req-{uuid.uuid4().hex[:24]}"
        _scope_state(scope)["request_id"] = rid
        started = False

        async def send_with_id(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                headers = list(message.get("headers", ()))
                headers.append((b"x-request-id", rid.encode()))
                message = {**message, "headers": headers}
            await send(message)

        if self.allowed_hosts is not None and not self._host_ok(scope):
            await send_error(
                send_with_id,
                scope,
                APIError(400, "invalid Host header (not in --allowed-hosts)", code="invalid_host"),
            )
            return
        gate = self.gate
        if gate is not None and gate.refuses(scope["path"]):
            closing = [(b"connection", b"close"), (b"retry-after", b"1")]
            await send_error(send_with_id, scope, gate.refusal(), closing)
            return
        if gate is not None:
            gate.active += 1
        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - never a traceback to the client
            logger.exception("request %s (%s %s) failed", rid, scope.get("method"), scope["path"])
            if not started:
                await send_error(send_with_id, scope, internal_error())
        finally:
            if gate is not None:
                gate.active -= 1

    def _host_ok(self, scope: dict) -> bool:
        raw = _header(scope, b"host")
        if raw is None:
            return False
        host = raw.decode("latin-1").strip().lower()
        if host.startswith("["):  # [v6]:port
            host = host[: host.find("]") + 1] if "]" in host else host
        else:
            host = host.rsplit(":", 1)[0] if host.count(":") == 1 else host
        return "*" in self.allowed_hosts or host in self.allowed_hosts


class AuthMiddleware:
    """With API keys, every route but ``/health`` needs ``Authorization: Bearer KEY``; checked
    before the body is read. Records the caller's tenant (``key-<hash>``, or the client
    address when no keys are set) in the request state (``tenant``, ``tenant_keyed``).

    Args:
      app: the ASGI app.
      keys: API key -> tenant name (:func:`paxcache.server.tenants.key_tenants`); empty: no
        authentication.
    """

    OPEN_PATHS = frozenset({"/health"})

    def __init__(self, app: Any, keys: Mapping[str, str]) -> None:
        self.app = app
        self.keys = [(k.encode(), tenant) for k, tenant in keys.items()]

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        state = _scope_state(scope)
        if not self.keys:
            client = scope.get("client")
            state["tenant"] = f"addr-{client[0]}" if client else "addr-unknown"
            state["tenant_keyed"] = False
            await self.app(scope, receive, send)
            return
        tenant = self._tenant(scope)
        if tenant is None and scope["path"] not in self.OPEN_PATHS:
            await send_error(
                send,
                scope,
                APIError(
                    401,
                    "invalid or missing API key (send 'Authorization: Bearer KEY')",
                    type="authentication_error",
                    code="invalid_api_key",
                ),
            )
            return
        state["tenant"] = tenant
        state["tenant_keyed"] = True
        await self.app(scope, receive, send)

    def _tenant(self, scope: dict) -> str | None:
        header = _header(scope, b"authorization") or b""
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return None
        token = token.strip()
        found = None
        for key, tenant in self.keys:  # compare against every key: no timing of which matched
            if secrets.compare_digest(token, key):
                found = tenant
        return found


class BodyLimitMiddleware:
    """Reads a request body up front, within ``max_bytes`` (413) and ``timeout_s`` (408),
    then replays it to the app; ``receive`` then passes through (disconnect detection)."""

    def __init__(self, app: Any, max_bytes: int, timeout_s: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.timeout_s = timeout_s

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        too_big = APIError(
            413, f"request body too large (limit max_body_bytes={self.max_bytes} bytes)"
        )
        length = _header(scope, b"content-length")
        if length is not None:
            try:
                n = int(length)
            except ValueError:
                await send_error(send, scope, APIError(400, "invalid Content-Length header"))
                return
            if n > self.max_bytes:
                await send_error(send, scope, too_big)
                return
        elif scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        more = True
        deadline = time.monotonic() + self.timeout_s
        while more:
            try:
                msg = await asyncio.wait_for(receive(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                await send_error(
                    send,
                    scope,
                    APIError(
                        408,
                        f"request body not received within body_timeout_s={self.timeout_s:g}",
                    ),
                )
                return
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await send_error(send, scope, too_big)
                return
            chunks.append(chunk)
            more = msg.get("more_body", False)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


def install_middleware(
    app: FastAPI,
    limits: ServerLimits,
    tenants_by_key: Mapping[str, str],
    allowed_hosts: Sequence[str] | None,
    gate: Any = None,
) -> None:
    """Adds the three middlewares to ``app`` (the request context outermost; ``gate``: the
    shutdown state it drains with)."""
    # Added innermost first: the request context wraps auth, which wraps the body limits.
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=limits.max_body_bytes, timeout_s=limits.body_timeout_s
    )
    app.add_middleware(AuthMiddleware, keys=tenants_by_key)
    app.add_middleware(
        RequestContextMiddleware,
        allowed_hosts=frozenset(h.lower() for h in allowed_hosts) if allowed_hosts else None,
        gate=gate,
    )
