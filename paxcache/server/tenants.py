"""Tenants: who is calling, their prefix-cache namespace and their share of the server.

Each API key is a tenant (``key-`` + a hash prefix: the key itself is never logged); without
keys, each client address is (:class:`paxcache.server.middleware.AuthMiddleware` records it).
A keyed tenant's requests get its own prefix-cache salt (:func:`tenant_salt`, vLLM's
``cache_salt`` namespaced by the key), so no tenant can time another's cached prompts (the
README's prefix-cache threat model). :class:`TenantSlots` caps the completions one tenant has
in flight (``ServerLimits.max_inflight_per_tenant``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from paxcache.server.protocol import APIError

__all__ = ["TenantSlots", "api_keys", "key_tenants", "tenant_salt"]


def api_keys(api_key: str | Sequence[str] | None) -> list[str]:
    """The API keys ``create_app(api_key=)`` was given, as a list (empty: no auth).

    Raises:
      ValueError: a key that is empty, not a string, or has surrounding whitespace.
    """
    keys = [api_key] if isinstance(api_key, str) else list(api_key or [])
    if any(not isinstance(k, str) or not k or k != k.strip() for k in keys):
        raise ValueError("API keys must be non-empty strings without surrounding whitespace")
    return keys


def key_tenants(keys: Sequence[str]) -> dict[str, str]:
    """API key -> tenant name (``key-`` + a hash prefix: the key itself is never logged)."""
    return {k: "key-" + hashlib.sha256(k.encode()).hexdigest()[:16] for k in keys}


def tenant_salt(state: Mapping[str, Any], cache_salt: str | None) -> str | None:
    """The engine ``cache_salt`` for a request: with API keys, the tenant's own namespace (its
    default salt, or its ``cache_salt`` inside it); without keys, the client's ``cache_salt``
    (None: the shared cache).

    Args:
      state: the request's ASGI state (``tenant``, ``tenant_keyed`` from the auth middleware).
      cache_salt: the request's ``cache_salt`` field.
    """
    if not state.get("tenant_keyed"):
        return cache_salt
    tenant = state["tenant"]
    return tenant if cache_salt is None else f"{tenant}/{cache_salt}"


class TenantSlots:
    """Completions in flight per tenant (``ServerLimits.max_inflight_per_tenant``).

    Used from the event loop only (no lock).
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.inflight: dict[str, int] = {}

    def acquire(self, tenant: str, n: int) -> Callable[[], None]:
        """Reserves ``n`` completions; returns the (idempotent) release.

        Raises:
          APIError: 429 ``tenant_limit`` when the tenant would exceed its limit.
        """
        used = self.inflight.get(tenant, 0)
        if used + n > self.limit:
            raise APIError(
                429,
                f"too many requests in flight for this API key or client: {used} completions "
                f"running, this request adds {n} (limit max_inflight_per_tenant={self.limit}); "
                "retry later",
                type="rate_limit_error",
                code="tenant_limit",
            )
        self.inflight[tenant] = used + n
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                left = self.inflight.get(tenant, 0) - n
                if left > 0:
                    self.inflight[tenant] = left
                else:
                    self.inflight.pop(tenant, None)

        return release
