"""Multi-host lockstep: process 0's rounds, their wire schema, and the follower loop.

With ``jax.process_count() > 1`` every process must make the same engine calls in the same
order (the jitted step is one SPMD program over every host's devices), and only process 0
serves HTTP. Each round, process 0's engine thread (:class:`paxcache.server.runner.
EngineRunner`) first broadcasts (:func:`paxcache.sharding.broadcast_from_leader`) that round
as an :class:`EngineRound` (JSON of known fields, validated on receipt; never pickle): new
requests, aborts, whether to sample stats, and a shutdown flag; then it applies them and
steps. Every other process runs :func:`run_follower`, which receives the same round and makes
the same calls. Requests without a seed get one drawn on process 0
(:func:`with_leader_seed`), so sampling matches on every host. While idle the leader still
sends an empty round every :data:`HEARTBEAT_S` seconds; on shutdown it sends a final round
that ends the followers.

This module depends on the engine's interface, :mod:`paxcache.sampling` and
:mod:`paxcache.sharding` only (nothing of the HTTP side), so it can live beside the engine.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import sys
from dataclasses import dataclass
from typing import Any

from paxcache.errors import PaxcacheError
from paxcache.sampling import SamplingParams

__all__ = [
    "HEARTBEAT_S",
    "MAX_REQUEST_ID_CHARS",
    "EngineRound",
    "RoundAdd",
    "RoundError",
    "broadcast_round",
    "process_count",
    "run_follower",
    "with_leader_seed",
]

logger = logging.getLogger(__name__)

HEARTBEAT_S = 5.0
"""Most seconds between two broadcast rounds while the leader is idle."""

MAX_REQUEST_ID_CHARS = 256
"""Longest request id a round may carry."""

_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


class RoundError(PaxcacheError):
    """A multi-host round received from process 0 does not match the schema."""


@dataclass(frozen=True)
class RoundAdd:
    """One request of a round: ``engine.add_request(request_id, prompt, params,
    cache_salt=cache_salt)``."""

    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    cache_salt: str | None = None


@dataclass(frozen=True)
class EngineRound:
    """What process 0 broadcasts each round (see the module docstring).

    Attributes:
      stop: the server is shutting down; followers return after the aborts.
      aborts: request ids to abort, in order.
      adds: requests to add, in order.
      stats: sample ``engine.stats()`` after this round's step.
    """

    stop: bool
    aborts: tuple[str, ...]
    adds: tuple[RoundAdd, ...]
    stats: bool

    def to_wire(self) -> dict[str, Any]:
        """A JSON-serializable dict (``sharding.broadcast_from_leader`` sends JSON)."""
        return {
            "stop": self.stop,
            "aborts": list(self.aborts),
            "adds": [
                {
                    "request_id": a.request_id,
                    "prompt": a.prompt,
                    "params": {
                        k: list(v) if isinstance(v, tuple) else v
                        for k, v in dataclasses.asdict(a.params).items()
                    },
                    "cache_salt": a.cache_salt,
                }
                for a in self.adds
            ],
            "stats": self.stats,
        }

    @classmethod
    def from_wire(cls, d: Any) -> EngineRound:
        """Validates a received round: exactly the known fields, each of the right type.

        Raises:
          RoundError: naming the first field that does not match.
        """

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise RoundError(f"invalid multi-host round: {what}")

        def is_id(x: Any) -> bool:
            return isinstance(x, str) and 0 < len(x) <= MAX_REQUEST_ID_CHARS

        need(isinstance(d, dict) and set(d) == {"stop", "aborts", "adds", "stats"}, "fields")
        need(isinstance(d["stop"], bool) and isinstance(d["stats"], bool), "stop/stats")
        need(isinstance(d["aborts"], list) and all(map(is_id, d["aborts"])), "aborts")
        need(isinstance(d["adds"], list), "adds")
        adds = []
        for a in d["adds"]:
            need(
                isinstance(a, dict) and set(a) == {"request_id", "prompt", "params", "cache_salt"},
                "add fields",
            )
            need(is_id(a["request_id"]), "add request_id")
            p = a["prompt"]
            need(
                isinstance(p, str)
                or (
                    isinstance(p, list)
                    and all(isinstance(t, int) and not isinstance(t, bool) for t in p)
                ),
                "add prompt",
            )
            need(a["cache_salt"] is None or isinstance(a["cache_salt"], str), "add cache_salt")
            params = a["params"]
            need(isinstance(params, dict) and set(params) == set(_PARAM_FIELDS), "add params")
            try:
                sp = SamplingParams(**params)
            except (ValueError, TypeError) as e:
                raise RoundError(f"invalid multi-host round: add params: {e}") from None
            adds.append(RoundAdd(a["request_id"], p, sp, a["cache_salt"]))
        return cls(d["stop"], tuple(d["aborts"]), tuple(adds), d["stats"])


def process_count() -> int:
    """``jax.process_count()`` if JAX is already imported (never imports it: fake engines)."""
    jax = sys.modules.get("jax")
    return int(jax.process_count()) if jax is not None else 1


def with_leader_seed(params: SamplingParams) -> SamplingParams:
    """``params`` with a seed drawn here (on process 0) when it has none, so every host samples
    the same tokens."""
    if params.seed is not None:
        return params
    return dataclasses.replace(params, seed=secrets.randbits(62))


def broadcast_round(rnd: EngineRound) -> None:
    """Process 0: sends ``rnd`` to every :func:`run_follower` (before anything is applied)."""
    from paxcache import sharding

    sharding.broadcast_from_leader(rnd.to_wire())


def _receive_round() -> EngineRound:
    from paxcache import sharding

    try:
        return EngineRound.from_wire(sharding.broadcast_from_leader(None))
    except (RoundError, ValueError) as e:
        logger.error("follower received an invalid round from process 0: %s", e)
        raise RoundError(str(e)) from None


def run_follower(engine: Any, *, warmup: bool = True) -> None:
    """Runs ``engine`` on a process other than 0 of a multi-host server, until it shuts down.

    Mirrors process 0's engine thread (see the module docstring): warms up, then each round
    receives process 0's :class:`EngineRound` and makes the same ``abort`` / ``add_request`` /
    ``step`` / ``stats`` calls in the same order, discarding the outputs. Returns when process
    0 sends its shutdown round.

    Args:
      engine: this process's ``Engine``, built with the same arguments as process 0's.
      warmup: call ``engine.warmup()`` first (as process 0's ``create_app(warmup=)``).

    Raises:
      RoundError: a received round does not match the schema (the hosts can no longer stay
        in lockstep, so the follower stops rather than guess).
    """
    if warmup:
        try:
            engine.warmup()
        except Exception:  # noqa: BLE001 - the leader keeps going too
            logger.exception("engine warm-up failed")
    live: dict[str, None] = {}  # the leader's sinks: requests added and not finished, in order

    def stats() -> None:
        try:
            engine.stats()
        except Exception:  # noqa: BLE001
            logger.exception("engine.stats() failed")

    def abort(rid: str) -> None:
        live.pop(rid, None)
        try:
            engine.abort(rid)
        except Exception:  # noqa: BLE001
            logger.exception("engine.abort(%r) failed", rid)

    stats()
    while True:
        rnd = _receive_round()
        for rid in rnd.aborts:
            abort(rid)
        if rnd.stop:
            stats()
            logger.info("leader shut down; follower exiting")
            return
        for add in rnd.adds:
            try:
                engine.add_request(
                    add.request_id, add.prompt, add.params, cache_salt=add.cache_salt
                )
            except Exception:  # noqa: BLE001 - the leader got the same error and answered it
                continue
            live[add.request_id] = None
        if not engine.has_unfinished_requests():
            stats()
            continue
        try:
            outs = engine.step()
        except Exception:  # noqa: BLE001 - as the leader: fail (abort) the requests in flight
            logger.exception("engine.step() failed; aborting the requests in flight")
            outs = []
            for rid in list(live):
                abort(rid)
        for out in outs:
            if out.finished:
                live.pop(out.request_id, None)
        if rnd.stats:
            stats()
