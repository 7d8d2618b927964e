"""Where an engine's arrays live and whose defaults it takes: :class:`Placement`.

The engine asks its placement, never a private hook, for the platform its programs run on
(batch-limit and ``decode_steps`` defaults, KV sizing), the accelerator's memory figures, and
the weights, block state and KV cache placed on the devices (split over a ``tp`` / ``ep`` mesh
when there is one). :class:`Placement` is the live devices of this process;
:class:`paxcache.compile_check.AbstractPlacement` places abstract values on a TPU topology or a
stand-in for a GPU, so the same engine is built and compiled with no chip.
"""

from __future__ import annotations

from typing import Any

import jax

from paxcache import allocator, kv_cache
from paxcache.config import CacheConfig

__all__ = ["Placement"]


class Placement:
    """The live devices of this process (``jax.devices()``): the engine's default placement.

    Attributes:
      runs: whether values placed here can be computed on (False for abstract values: the
        engine then runs no 8-bit KV calibration at construction).
    """

    runs: bool = True

    def backend(self) -> str:
        """The platform the engine's programs run on (``"cpu"``, ``"tpu"``, ``"gpu"``)."""
        return jax.default_backend()

    def on_accelerator(self) -> bool:
        """Whether the default KV sizing takes a fraction of free accelerator memory."""
        return self.backend() != "cpu"

    def memory_stats(self) -> dict[str, int] | None:
        """The memory figures KV sizing uses; None: the first device's ``memory_stats()``."""
        return None

    def place_params(self, model: Any, params: Any, tp: int, ep: int) -> tuple[Any, Any]:
        """``(mesh, params)``: no mesh for ``tp == ep == 1``, else the weights sharded over a
        ``tp`` x ``ep`` mesh (:func:`paxcache.sharding.setup_tensor_parallel`)."""
        if tp == ep == 1:
            return None, params
        from paxcache import sharding

        return sharding.setup_tensor_parallel(model, params, tp, ep)

    def init_state(self, cache_config: CacheConfig, mesh: Any) -> allocator.BlockState:
        """The empty block state, committed to the device like every later (jit-produced)
        state, so the first step after warm-up hits the same compiled executable
        (replicated on every device of ``mesh``, every host's, when there is one)."""
        state = allocator.init(cache_config)
        if mesh is None:
            return jax.device_put(state, jax.devices()[0])
        from paxcache import sharding

        return sharding.place(state, sharding.replicated(mesh))

    def create_kv(self, mesh: Any, **dims: Any) -> kv_cache.KVCache:
        """The KV cache of ``dims`` (:meth:`paxcache.kv_cache.KVCache.create`'s arguments),
        split over kv heads on ``mesh``'s ``tp`` axis when there is one."""
        from paxcache import sharding

        where = None if mesh is None else sharding.kv_sharding(mesh)
        return kv_cache.KVCache.create(**dims, sharding=where)
