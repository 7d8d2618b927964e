"""Session-wide test settings.

The engine turns on JAX's persistent compilation cache by default (``paxcache.compile_cache``)
in a per-user directory. Tests point it at a fresh directory per session instead, so they run
the default code path (cache on) without reading or writing the user's cache.
"""

from __future__ import annotations

import os
import tempfile

_SESSION_CACHE = tempfile.mkdtemp(prefix="paxcache-test-jax-cache-")
os.environ.setdefault("PAXCACHE_COMPILE_CACHE", _SESSION_CACHE)
