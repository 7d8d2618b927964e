"""paxcache: a paged KV-cache runtime for LLM inference in JAX.

Letter convention used in shapes across the project:
B batch (sequences / slots), T tokens, H query heads, K kv heads, D head dim,
N device blocks, NH host blocks, S block size (tokens per block), M max blocks per sequence,
L layers, V vocabulary.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Heavy or late-landing pieces are imported lazily so `import paxcache` stays cheap and a
# missing optional dependency (e.g. the server's) never breaks the allocator.
_LAZY = {
    "CacheConfig": ("paxcache.config", "CacheConfig"),
    "BlockManager": ("paxcache.manager", "BlockManager"),
    "allocator": ("paxcache.allocator", None),
    "errors": ("paxcache.errors", None),
    "models": ("paxcache.models", None),
    "Engine": ("paxcache.engine", "Engine"),
    "SamplingParams": ("paxcache.sampling", "SamplingParams"),
    "StructuredOutputsParams": ("paxcache.sampling", "StructuredOutputsParams"),
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        mod_name, attr = _LAZY[name]
        mod = importlib.import_module(mod_name)
        value = mod if attr is None else getattr(mod, attr)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'paxcache' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
