"""JAX's persistent compilation cache, on by default for the engine and the server.

Compiling an engine's step for every token bucket takes seconds per bucket on a CPU and
minutes for a real model on an accelerator, at every start. JAX can keep the compiled
executables on disk (``jax_compilation_cache_dir``) and load them instead of compiling when
the same program is built again (same HLO, JAX/jaxlib version, backend, devices and flags).
:func:`enable` points JAX at a per-user directory:

* ``$PAXCACHE_COMPILE_CACHE`` if set, else
* ``$XDG_CACHE_HOME/paxcache/jax`` (``~/.cache/paxcache/jax`` when ``XDG_CACHE_HOME`` is
  unset),

created with mode ``0700``: JAX loads executables from this directory and runs them, so it
must not be writable by anyone you do not trust (JAX's own warning).

Every program is cached, however fast it compiled (``jax_persistent_cache_min_compile_time_secs
= 0``) and however small (``jax_persistent_cache_min_entry_size_bytes = -1``): on CPU the
engine's step compiles in a few seconds, below JAX's 1 s / filesystem-dependent defaults only
for the small allocator programs, and a warm start should compile nothing. Donated buffers
are fine: donation is part of the compiled program, and a loaded executable aliases its
inputs like a freshly compiled one.

The setting is process-wide (JAX has one cache). :func:`enable` with the directory already
in use does nothing; with another directory it switches JAX to it (JAX's cache object is
reset so the change takes effect even after earlier compilations). A directory the user set
through JAX itself (``JAX_COMPILATION_CACHE_DIR`` or ``jax.config``) is kept when no
directory is asked for.

Several processes share one directory (two servers, a server and its tests, the processes
of a multi-host run on one machine). JAX writes an entry in place, unlocked, unless the cache
has a size limit; a process reading an entry another is still writing then deserializes a
torn executable (a crash seen once in this project's test suite). :func:`enable` therefore
sets a size limit (:data:`DEFAULT_MAX_BYTES`, unless one is set already), which makes JAX take
a file lock around every read and write (and evict least-recently-used entries beyond it).

Processes joined by ``jax.distributed`` on CPU devices (multi-host tests and development) run
without the cache: on JAX 0.12.1 their gloo collectives never meet when one process loads a
program from the cache and another compiles it (seen as a hang in the first step of a
two-process server whose cache held part of its programs; both loading, or both compiling,
works). On TPU and GPU the cache stays on.

Counters: :func:`cache_hits` counts executables loaded from the cache in this process (JAX's
``/jax/compilation_cache/cache_hits`` event); :func:`backend_compiles` counts every XLA
backend compilation (JAX's compile event, which also fires for an executable loaded from the
cache: the engine's ``num_compilations`` subtracts the hits).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

import jax

__all__ = [
    "backend_compiles",
    "cache_hits",
    "cache_misses",
    "check_memory_maps",
    "current_dir",
    "default_dir",
    "disable",
    "enable",
    "memory_maps",
    "resolve",
]

logger = logging.getLogger(__name__)

ENV_VAR = "PAXCACHE_COMPILE_CACHE"

_HITS = [0]
_MISSES = [0]
_BACKEND_COMPILES = [0]


def _on_event(event: str, **kwargs: Any) -> None:
    if event == "/jax/compilation_cache/cache_hits":
        _HITS[0] += 1
    elif event == "/jax/compilation_cache/cache_misses":
        _MISSES[0] += 1


def _on_duration_event(event: str, duration: float, **kwargs: Any) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
        _BACKEND_COMPILES[0] += 1


jax.monitoring.register_event_listener(_on_event)
jax.monitoring.register_event_duration_secs_listener(_on_duration_event)


def backend_compiles() -> int:
    """XLA backend compilations in this process so far (a cache miss that re-lowers a cached
    trace counts too, not only retraces; loads from the persistent cache count as well)."""
    return _BACKEND_COMPILES[0]


def cache_hits() -> int:
    """Executables loaded from the persistent cache by this process so far."""
    return _HITS[0]


def cache_misses() -> int:
    """Programs looked up in the persistent cache and not found (then compiled and stored)."""
    return _MISSES[0]


MAPS_WARN_FRACTION = 0.75


def memory_maps() -> tuple[int, int] | None:
    """``(maps held, limit)``: this process's memory maps and Linux's ``vm.max_map_count``;
    None where either cannot be read (not Linux)."""
    try:
        with open("/proc/self/maps", "rb") as f:
            held = sum(1 for _ in f)
        with open("/proc/sys/vm/max_map_count") as f:
            limit = int(f.read().strip())
    except (OSError, ValueError):
        return None
    return held, limit


def check_memory_maps(maps: tuple[int, int] | None = None) -> bool:
    """Warns (once per call, logger ``paxcache.compile_cache``) when the process holds more than
    ``MAPS_WARN_FRACTION`` of ``vm.max_map_count`` memory maps; returns whether it warned.

    XLA:CPU keeps each compiled program's code in memory maps for as long as JAX caches the
    executable, and every engine configuration compiles its own programs. A process that builds
    many engines (a notebook, a test session) can reach the kernel's limit; the next compile or
    cache load then fails inside LLVM's JIT linker, which aborts the process rather than
    raising. ``jax.clear_caches()`` releases the programs of engines no longer in use.

    Args:
      maps: ``(held, limit)``; default :func:`memory_maps` now.
    """
    maps = memory_maps() if maps is None else maps
    if maps is None:
        return False
    held, limit = maps
    if limit <= 0 or held <= MAPS_WARN_FRACTION * limit:
        return False
    logger.warning(
        "this process holds %d memory maps of the kernel's limit vm.max_map_count=%d; compiled "
        "XLA programs of earlier engines hold them. Past the limit the next compile aborts the "
        "process (LLVM report_fatal_error or std::bad_alloc). Call jax.clear_caches() after "
        "dropping engines, or raise the limit (sysctl vm.max_map_count)",
        held,
        limit,
    )
    return True


def default_dir() -> Path:
    """The per-user cache directory (see the module docstring); not created here."""
    env = os.environ.get(ENV_VAR)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "paxcache" / "jax"


def current_dir() -> str | None:
    """The directory JAX's persistent cache uses now, or None when it is off."""
    return jax.config.jax_compilation_cache_dir or None


def resolve(compile_cache: str | os.PathLike[str] | bool | None) -> Path | None:
    """The directory an engine's ``compile_cache`` argument asks for (None: leave JAX alone).

    Args:
      compile_cache: ``None`` or ``True``: the default (a directory already configured in
        JAX, else :func:`default_dir`); a path: that directory; ``False``: no cache.

    Raises:
      ValueError: a value of another type, or an empty path.
    """
    if compile_cache is False:
        return None
    if compile_cache is None or compile_cache is True:
        configured = current_dir()
        return Path(configured) if configured else default_dir()
    if isinstance(compile_cache, (str, os.PathLike)) and str(compile_cache):
        return Path(compile_cache).expanduser()
    raise ValueError(
        "compile_cache must be a directory path, None (the default per-user directory) or "
        f"False (off), got {compile_cache!r}"
    )


DEFAULT_MAX_BYTES = 16 << 30
"""Size limit :func:`enable` gives JAX's cache (least-recently-used entries go beyond it); any
limit turns on JAX's file lock, which keeps concurrent processes from reading torn entries."""


def _lock_cache() -> None:
    """A size limit (hence JAX's cross-process file lock) unless the user set one."""
    if jax.config.jax_compilation_cache_max_size == -1:
        jax.config.update("jax_compilation_cache_max_size", DEFAULT_MAX_BYTES)


def enable(path: str | os.PathLike[str] | None = None) -> Path | None:
    """Turns on JAX's persistent compilation cache in ``path`` (default :func:`default_dir`).

    Returns:
      The directory in use, or None when it cannot be created or written (then the cache
      stays off and a warning says why: a read-only home must not stop the engine).
    """
    if _multi_process_cpu():
        logger.warning(
            "persistent compile cache off: processes joined by jax.distributed on CPU devices "
            "must all compile or all load each program (JAX 0.12.1's gloo collectives hang "
            "when one process loads an executable another compiled)"
        )
        disable()
        return None
    target = Path(path).expanduser() if path is not None else default_dir()
    try:
        target.mkdir(parents=True, exist_ok=True, mode=0o700)
        if not os.access(target, os.W_OK | os.X_OK):
            raise PermissionError(f"{target} is not writable")
    except OSError as e:
        logger.warning("persistent compile cache off: cannot use %s (%s)", target, e)
        return None
    target = target.resolve()
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    _lock_cache()
    if current_dir() != str(target):
        from jax.experimental.compilation_cache import compilation_cache as cc

        jax.config.update("jax_compilation_cache_dir", str(target))
        cc.reset_cache()  # JAX initializes its cache once; make it pick up the new directory
        logger.info("persistent compile cache: %s", target)
    return target


def _multi_process_cpu() -> bool:
    """Whether this process is one of several joined by ``jax.distributed`` on CPU devices."""
    if not jax.distributed.is_initialized() or jax.process_count() == 1:
        return False
    return jax.devices()[0].platform == "cpu"


def disable() -> None:
    """Turns JAX's persistent compilation cache off for this process."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    jax.config.update("jax_compilation_cache_dir", None)
    cc.reset_cache()
