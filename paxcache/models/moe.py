"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE on the Llama code path.

Shape letters as in :mod:`paxcache.models.llama`, plus X experts, Xl experts on one device,
k experts per token (``num_experts_per_tok``), Fm the experts' width
(``moe_intermediate_size``), A = N * k token-expert assignments of N tokens.

Attention, norms, RoPE and the two forward paths (dense reference and paged) are
:class:`~paxcache.models.llama.LlamaForCausalLM`'s; only the MLP differs. A layer is a
mixture of experts unless it is listed in ``mlp_only_layers`` or skipped by
``decoder_sparse_step`` (Qwen3-MoE; HF's rule: layer ``i`` is sparse iff
``i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0``); dense layers keep a
SwiGLU MLP of width ``intermediate_size``.

**Routing** (HF's ``MixtralTopKRouter`` / ``Qwen3MoeTopKRouter``): float32 softmax over the
router logits, the top k probabilities (``jax.lax.top_k``: on equal probabilities the
**lower expert index wins**, as in ``torch.topk``), renormalized to sum 1 when
``norm_topk_prob`` (always for Mixtral).

**Experts as a grouped matmul.** The A assignments are sorted by expert (stable), the token
rows gathered in that order, and each expert's weights applied to its contiguous run of
rows with ``jax.lax.ragged_dot`` (group sizes = tokens per expert): gate and up ``[X, E,
Fm]``, SiLU(gate) * up, down ``[X, Fm, E]``; each row is scaled by its routing weight and
scatter-added back to its token. On TPU and GPU ``ragged_dot`` is XLA's grouped matmul
(work ~ A rows); off-accelerator XLA expands it to a masked dense product over all experts
(``scripts/bench_moe.py`` measures both against a dense all-experts einsum).

**Expert parallelism** (``Engine(..., ep=N)``, :mod:`paxcache.sharding`): the mesh is
``(ep, tp)``; expert weights are split over experts on ``ep`` and over Fm on ``tp``
(gate/up column-, down row-parallel). Attention is split over heads on ``tp`` only and
replicated over ``ep``, so after attention every device holds every token (all-gather
placement: no token all-to-all is needed). Each device routes all tokens (the router is
replicated), keeps the assignments to its own Xl = X / ep experts (the others sort last and
count in no group), runs its grouped matmuls, and one all-reduce (``psum`` over ``ep`` and
``tp``) of the ``[N, E]`` result combines the experts' and the Fm shards' partial sums; it
replaces the all-reduce a tensor-parallel dense MLP has anyway.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
from collections.abc import Callable, Container, Iterator, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from paxcache import sharding
from paxcache.attention import AttentionMetadata
from paxcache.models.llama import LlamaForCausalLM, LlamaLayers, _dense
from paxcache.models.llama_config import ConfigError, LlamaConfig
from paxcache.models.shards import EXPERT, LAYER, TensorSource

__all__ = [
    "MoeConfig",
    "MoeForCausalLM",
    "MoeLayers",
    "expert_mlp",
    "hf_expert_shapes",
    "expert_sources",
    "moe_hf_tensors",
    "moe_mlp",
    "route",
]

_MAX_EXPERTS = 4096

# The mesh of the paged step being traced (set by MoeForCausalLM.hidden_states_paged from
# the step's metadata, read by the MLP inside the layer scan); None: one device.
_STEP_MESH: contextvars.ContextVar[jax.sharding.Mesh | None] = contextvars.ContextVar(
    "paxcache_moe_step_mesh", default=None
)


@dataclasses.dataclass(frozen=True)
class MoeConfig(LlamaConfig):
    """A :class:`~paxcache.models.llama_config.LlamaConfig` with a mixture-of-experts MLP.

    Attributes (beyond LlamaConfig's):
        num_experts: X (HF ``num_local_experts`` / ``num_experts``).
        num_experts_per_tok: k, experts per token.
        moe_intermediate_size: Fm, each expert's SwiGLU width (Mixtral: ``intermediate_size``;
            None means ``intermediate_size``). ``intermediate_size`` is the dense layers' width.
        norm_topk_prob: renormalize the top-k routing weights to sum 1.
        decoder_sparse_step: every ``decoder_sparse_step``-th layer is sparse (Qwen3-MoE).
        mlp_only_layers: layers with a dense MLP instead of experts.
    """

    num_experts: int = 8
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool = True
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    __hash__ = LlamaConfig.__hash__

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.moe_intermediate_size is None:
            object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        for name, hi in (
            ("num_experts", _MAX_EXPERTS),
            ("num_experts_per_tok", self.num_experts),
            ("moe_intermediate_size", 1 << 19),
            ("decoder_sparse_step", self.num_hidden_layers),
        ):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= max(hi, 1):
                raise ConfigError(f"config field {name} must be an int in [1, {hi}], got {v!r}")
        for i in self.mlp_only_layers:
            if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < self.num_hidden_layers:
                raise ConfigError(
                    f"config field mlp_only_layers holds {i!r}, not a layer index in "
                    f"[0, {self.num_hidden_layers})"
                )
        if self.norm_placement != "pre":
            raise ConfigError("mixture-of-experts models use norm_placement='pre'")

    def moe_layer_flags(self) -> tuple[bool, ...]:
        """Per layer: a mixture of experts (True) or a dense MLP (False); HF's rule."""
        return tuple(
            i not in self.mlp_only_layers and (i + 1) % self.decoder_sparse_step == 0
            for i in range(self.num_hidden_layers)
        )

    def num_params(self) -> int:
        """Number of parameters (all experts counted; a tied embedding once)."""
        e, f, fm, x = (
            self.hidden_size,
            self.intermediate_size,
            self.moe_intermediate_size,
            self.num_experts,
        )
        flags = self.moe_layer_flags()
        n_moe = sum(flags)
        dense_mlp = 3 * e * f
        base = super().num_params() - self.num_hidden_layers * dense_mlp
        return base + (len(flags) - n_moe) * dense_mlp + n_moe * (e * x + 3 * x * e * fm)

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> MoeConfig:
        """Reads a Mixtral or Qwen3-MoE ``config.json`` (both ``num_local_experts``, written
        by transformers 5, and the hub's ``num_experts``).

        Raises:
            ConfigError: a missing or malformed expert field, named.
        """
        base = super().from_hf_dict(d)
        mt = d.get("model_type")
        n = d.get("num_local_experts", d.get("num_experts"))
        if n is None:
            raise ConfigError("config.json is missing num_local_experts (or num_experts)")
        if "num_experts_per_tok" not in d:
            raise ConfigError("config.json is missing required field 'num_experts_per_tok'")
        fields: dict[str, Any] = {"num_experts": n, "num_experts_per_tok": d["num_experts_per_tok"]}
        if mt == "qwen3_moe":  # Qwen3MoeConfig's defaults where config.json omits a field
            fields.update(
                moe_intermediate_size=d.get("moe_intermediate_size", 768),
                norm_topk_prob=d.get("norm_topk_prob", False),
                decoder_sparse_step=d.get("decoder_sparse_step", 1),
                mlp_only_layers=tuple(d.get("mlp_only_layers") or ()),
            )
        for name in ("norm_topk_prob",):
            if not isinstance(fields.get(name, True), bool):
                raise ConfigError(f"config field {name} must be true or false")
        if not isinstance(fields.get("mlp_only_layers", ()), tuple):
            raise ConfigError("config field mlp_only_layers must be a list of layer indices")
        return dataclasses.replace(base, **fields)

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF ``config.json`` dict (round-trips through :meth:`from_hf_dict`).

        Raises:
            ConfigError: a Mixtral config with dense layers or unnormalized routing (Mixtral
                has neither), or anything :meth:`LlamaConfig.to_hf_dict` refuses.
        """
        d = super().to_hf_dict()
        d["num_local_experts"] = self.num_experts
        d["num_experts_per_tok"] = self.num_experts_per_tok
        if self.model_type == "mixtral":
            if not all(self.moe_layer_flags()) or not self.norm_topk_prob:
                raise ConfigError("mixtral has experts on every layer and normalized routing")
            if self.moe_intermediate_size != self.intermediate_size:
                raise ConfigError("mixtral's experts are intermediate_size wide")
        else:
            d.update(
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return d


# ------------------------------------------------------------------------------------------
# Routing and the grouped expert MLP (pure functions)
# ------------------------------------------------------------------------------------------


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """Top-k routing of HF's Mixtral / Qwen3-MoE routers.

    Args:
        logits: [N, X] router logits.
        k: experts per token.
        normalize: rescale the k weights to sum 1 (``norm_topk_prob``).

    Returns:
        (weights f32[N, k], experts i32[N, k]), experts in decreasing probability; on equal
        probabilities the lower expert index comes first (``jax.lax.top_k``'s rule, as
        ``torch.topk``'s).
    """
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, experts.astype(jnp.int32)


def expert_mlp(
    x: jax.Array,
    weights: jax.Array,
    experts: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    *,
    first_expert: jax.Array | int = 0,
    dtype: Any = jnp.float32,
    gate_up_bias: tuple[jax.Array, jax.Array] | None = None,
    activation: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """The routed tokens through experts ``first_expert .. first_expert + Xl - 1``.

    Args:
        x: [N, E] tokens.
        weights: f32[N, k] routing weights; experts: i32[N, k] their expert ids (global).
        w_gate, w_up: [Xl, E, Fm]; w_down: [Xl, Fm, E]: this device's experts.
        first_expert: the global id of ``w_*[0]`` (expert parallelism); assignments to other
            experts are dropped (they count in no group).
        dtype: compute dtype (float32 accumulation).
        gate_up_bias: optional (gate [Xl, Fm], up [Xl, Fm]) per-expert biases (gpt-oss).
        activation: ``act(gate, up) -> [A, Fm]`` on float32 projections; default SwiGLU
            ``silu(gate) * up``.

    Returns:
        f32[N, E]: sum over each token's assignments to these experts of weight * expert(x)
        (a down-projection bias is the caller's: it does not split over Fm).
    """
    n, e = x.shape
    n_local = w_gate.shape[0]
    local = experts.reshape(-1) - first_expert  # [A]
    is_local = (local >= 0) & (local < n_local)
    key = jnp.where(is_local, local, n_local)  # others sort last, outside every group
    order = jnp.argsort(key, stable=True)  # [A] assignments grouped by expert
    rows = order // experts.shape[1]  # the token of each sorted assignment
    group_sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
    xs = jnp.take(x, rows, axis=0).astype(dtype)  # [A, E]

    def gmm(a: jax.Array, w: jax.Array) -> jax.Array:
        return jax.lax.ragged_dot(
            a, w.astype(dtype), group_sizes, preferred_element_type=jnp.float32
        )

    gate, up = gmm(xs, w_gate), gmm(xs, w_up)  # [A, Fm]
    if gate_up_bias is not None:  # each sorted row's expert (rows of no group: any, dropped)
        row_expert = jnp.minimum(key[order], n_local - 1)
        gate = gate + jnp.take(gate_up_bias[0], row_expert, axis=0).astype(jnp.float32)
        up = up + jnp.take(gate_up_bias[1], row_expert, axis=0).astype(jnp.float32)
    act = jax.nn.silu(gate) * up if activation is None else activation(gate, up)
    act = act.astype(dtype)
    out = gmm(act, w_down)  # [A, E]; rows past the groups are zeros
    w_sorted = jnp.where(is_local, weights.reshape(-1), 0.0)[order]
    out = jnp.where(w_sorted[:, None] != 0, out * w_sorted[:, None], 0.0)
    return jnp.zeros((n, e), jnp.float32).at[rows].add(out)


def moe_mlp(
    x: jax.Array,
    router: jax.Array,
    w_gate: jax.Array,
    w_up: jax.Array,
    w_down: jax.Array,
    cfg: MoeConfig,
    *,
    dtype: Any = jnp.float32,
    mesh: jax.sharding.Mesh | None = None,
    router_bias: jax.Array | None = None,
    expert_biases: tuple[jax.Array, jax.Array, jax.Array] | None = None,
    route_fn: Callable[[jax.Array], tuple[jax.Array, jax.Array]] | None = None,
    activation: Callable[[jax.Array, jax.Array], jax.Array] | None = None,
) -> jax.Array:
    """One sparse MLP block: route, then :func:`expert_mlp` (per device under ``mesh``).

    Args:
        x: [..., E] tokens (normed).
        router: [E, X]; w_gate, w_up: [X, E, Fm]; w_down: [X, Fm, E].
        cfg: the config (k, ``norm_topk_prob``).
        dtype: compute dtype.
        mesh: None, or the step's mesh (axes ``tp`` and optionally ``ep``): experts split over
            ``ep`` and Fm over ``tp`` (:func:`paxcache.sharding.expert_specs`), tokens
            replicated, one ``psum`` combines (module docstring).
        router_bias: optional [X] router logit bias (gpt-oss).
        expert_biases: optional per-expert biases (gate [X, Fm], up [X, Fm], down [X, E]);
            gate/up split like their weights, the down bias added once after the combine
            (``sum_k w_k * b_down[e_k]``).
        route_fn: ``route_fn(logits f32[N, X]) -> (weights, experts)`` in place of
            :func:`route` with the config's k and ``norm_topk_prob``.
        activation: as in :func:`expert_mlp`.

    Returns:
        [..., E] in ``dtype``.
    """
    lead = x.shape[:-1]
    flat = x.reshape(-1, x.shape[-1])
    logits = jnp.einsum(
        "ne,ex->nx", flat.astype(dtype), router.astype(dtype), preferred_element_type=jnp.float32
    )
    if router_bias is not None:
        logits = logits + router_bias.astype(jnp.float32)
    if route_fn is None:
        weights, experts = route(logits, cfg.num_experts_per_tok, cfg.norm_topk_prob)
    else:
        weights, experts = route_fn(logits)
    gate_up_bias = None if expert_biases is None else tuple(expert_biases[:2])
    down_bias = 0.0
    if expert_biases is not None:  # [N, k, E] -> [N, E]
        picked = jnp.take(expert_biases[2], experts, axis=0).astype(jnp.float32)
        down_bias = jnp.einsum("nk,nke->ne", weights, picked)
    if mesh is None:
        y = expert_mlp(
            flat, weights, experts, w_gate, w_up, w_down, dtype=dtype,
            gate_up_bias=gate_up_bias, activation=activation,
        )  # fmt: skip
        return (y + down_bias).astype(dtype).reshape(*lead, -1)
    ep = int(mesh.shape.get(sharding.EP_AXIS, 1))
    specs = sharding.expert_specs(cfg, mesh)
    reduce_axes = tuple(
        ax for ax in (sharding.EP_AXIS, sharding.TP_AXIS) if ax in specs["expert_down"]
    )

    def local(flat, weights, experts, w_gate, w_up, w_down, *gate_up_bias):
        first = jax.lax.axis_index(sharding.EP_AXIS) * w_gate.shape[0] if ep > 1 else 0
        y = expert_mlp(
            flat, weights, experts, w_gate, w_up, w_down, first_expert=first, dtype=dtype,
            gate_up_bias=tuple(gate_up_bias) or None, activation=activation,
        )  # fmt: skip
        return jax.lax.psum(y, reduce_axes) if reduce_axes else y

    gate_spec = specs["expert_gate"]  # [L, X, E, Fm]: a gate/up bias [X, Fm] splits like it
    bias_specs = () if gate_up_bias is None else (P(gate_spec[1], gate_spec[3]),) * 2
    fn = jax.shard_map(
        local,
        mesh=mesh,
        in_specs=(
            P(),
            P(),
            P(),
            P(*gate_spec[1:]),  # without the [L] axis
            P(*specs["expert_up"][1:]),
            P(*specs["expert_down"][1:]),
            *bias_specs,
        ),
        out_specs=P(),
        check_vma=False,
    )
    y = fn(flat, weights, experts, w_gate, w_up, w_down, *(gate_up_bias or ()))
    return (y + down_bias).astype(dtype).reshape(*lead, -1)


# ------------------------------------------------------------------------------------------
# NNX modules
# ------------------------------------------------------------------------------------------


class MoeLayers(LlamaLayers):
    """:class:`~paxcache.models.llama.LlamaLayers` with the MLP split by layer kind.

    Attributes (beyond the attention and norm weights, stacked ``[L, ...]``):
        router: [Lm, E, X] (Lm sparse layers, in layer order).
        expert_gate, expert_up: [Lm, X, E, Fm]; expert_down: [Lm, X, Fm, E].
        gate_proj, up_proj: [Ld, E, F]; down_proj: [Ld, F, E] (Ld dense layers), or None.
    """

    def __init__(self, cfg: MoeConfig, *, param_dtype: Any, rngs: nnx.Rngs) -> None:
        super().__init__(cfg, param_dtype=param_dtype, rngs=rngs)
        e, f, fm, x = (
            cfg.hidden_size,
            cfg.intermediate_size,
            cfg.moe_intermediate_size,
            cfg.num_experts,
        )
        flags = cfg.moe_layer_flags()
        n_moe, n_dense = sum(flags), len(flags) - sum(flags)
        init = jax.nn.initializers.normal(0.02)

        def w(*shape: int) -> nnx.Param | None:
            if not shape[0]:
                return None
            return nnx.Param(init(rngs.params(), shape, jnp.float32).astype(param_dtype))

        self.gate_proj, self.up_proj, self.down_proj = (
            w(n_dense, e, f),
            w(n_dense, e, f),
            w(n_dense, f, e),
        )
        self.router = w(n_moe, e, x)
        self.expert_gate = w(n_moe, x, e, fm)
        self.expert_up = w(n_moe, x, e, fm)
        self.expert_down = w(n_moe, x, fm, e)
        # Per layer: its index among the sparse layers, among the dense layers (static).
        self.sparse_slots = tuple(int(i) for i in np.cumsum(flags) - 1)
        self.dense_slots = tuple(int(i) for i in np.cumsum([not f for f in flags]) - 1)

    MLP_NAMES = (
        "gate_proj",
        "up_proj",
        "down_proj",
        "router",
        "expert_gate",
        "expert_up",
        "expert_down",
    )

    def stacked(self) -> dict[str, jax.Array]:
        """The per-layer ``lax.scan`` xs: attention and norm weights, and ``layer`` (i32[L]).

        The MLP weights are indexed inside the scan by :meth:`mlp_params` (their stacks are
        over the sparse or the dense layers only).
        """
        out = {k: v for k, v in super().stacked().items() if k not in self.MLP_NAMES}
        out["layer"] = jnp.arange(len(self.sparse_slots), dtype=jnp.int32)
        return out

    def mlp_params(self, layer: jax.Array, sparse: bool) -> dict[str, jax.Array]:
        """One layer's MLP weights: ``router``, ``expert_*`` (sparse) or ``*_proj`` (dense)."""
        names = (
            ("router", "expert_gate", "expert_up", "expert_down") if sparse else self.MLP_NAMES[:3]
        )
        slot = jnp.asarray(self.sparse_slots if sparse else self.dense_slots, jnp.int32)[layer]
        return {
            n: jax.lax.dynamic_index_in_dim(getattr(self, n)[...], slot, keepdims=False)
            for n in names
        }


@contextlib.contextmanager
def _step_mesh(mesh: jax.sharding.Mesh | None) -> Iterator[None]:
    token = _STEP_MESH.set(mesh)
    try:
        yield
    finally:
        _STEP_MESH.reset(token)


class MoeForCausalLM(LlamaForCausalLM):
    """Mixtral / Qwen3-MoE causal LM: the Llama decoder with :func:`moe_mlp` layers.

    Same interface as :class:`~paxcache.models.llama.LlamaForCausalLM` (dense ``__call__``,
    ``forward_paged``); ``layers`` is a :class:`MoeLayers`.
    """

    def __init__(
        self,
        config: MoeConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        if not isinstance(config, MoeConfig):
            raise ConfigError(f"MoeForCausalLM needs a MoeConfig, got {type(config).__name__}")
        super().__init__(config, dtype=dtype, param_dtype=param_dtype, rngs=rngs)
        param_dtype = dtype if param_dtype is None else param_dtype
        self.layers = MoeLayers(config, param_dtype=param_dtype, rngs=rngs)

    def _mlp(self, layer: jax.Array, h: jax.Array) -> jax.Array:
        """The MLP of layer ``layer`` (traced) on normed ``h [..., E]``."""
        cfg, dt, layers = self.config, self.dtype, self.layers
        flags = cfg.moe_layer_flags()
        mesh = _STEP_MESH.get()

        def sparse(h: jax.Array) -> jax.Array:
            p = layers.mlp_params(layer, True)
            return moe_mlp(
                h,
                p["router"],
                p["expert_gate"],
                p["expert_up"],
                p["expert_down"],
                cfg,
                dtype=dt,
                mesh=mesh,
            )

        def dense(h: jax.Array) -> jax.Array:
            p = layers.mlp_params(layer, False)
            gate, up = _dense(h, p["gate_proj"], None, dt), _dense(h, p["up_proj"], None, dt)
            act = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dt)
            return _dense(act, p["down_proj"], None, dt)

        if all(flags):
            return sparse(h)
        if not any(flags):
            return dense(h)
        return jax.lax.cond(jnp.asarray(flags)[layer], sparse, dense, h)

    def _finish_layer(
        self, lp: Mapping[str, jax.Array], x: jax.Array, attn: jax.Array
    ) -> jax.Array:
        """Output projection, residual, then the layer's MLP (experts or dense) + residual."""
        cfg, dt = self.config, self.dtype
        attn = attn.reshape(*attn.shape[:-2], cfg.num_attention_heads * cfg.head_dim)
        x = x + _dense(attn, lp["o_proj"], lp.get("o_bias"), dt)
        h = self._norm(x, lp["post_attention_layernorm"])
        return x + self._mlp(lp["layer"], h)

    def hidden_states_paged(
        self, token_ids: jax.Array, kv_cache: Any, metadata: AttentionMetadata
    ) -> tuple[jax.Array, Any]:
        """As :meth:`LlamaForCausalLM.hidden_states_paged`; the experts run on the step's
        mesh (``metadata.mesh``: split over ``ep`` and ``tp``)."""
        with _step_mesh(metadata.mesh):
            return super().hidden_states_paged(token_ids, kv_cache, metadata)


# ------------------------------------------------------------------------------------------
# HF checkpoint layouts
# ------------------------------------------------------------------------------------------

# Our expert parameter -> (legacy per-expert name of Mixtral, of Qwen3-MoE).
_LEGACY = {
    "expert_gate": ("w1", "gate_proj"),
    "expert_up": ("w3", "up_proj"),
    "expert_down": ("w2", "down_proj"),
}


def _layout(cfg: MoeConfig, names: Container[str]) -> str:
    """ "fused" (transformers 5 in memory: ``mlp.experts.gate_up_proj`` [X, 2Fm, E],
    ``mlp.experts.down_proj`` [X, E, Fm]) or "legacy" (one tensor per expert: how
    ``save_pretrained`` writes them and the hub holds them), as the checkpoint's first sparse
    layer holds them (one layout per checkpoint)."""
    first = cfg.moe_layer_flags().index(True) if any(cfg.moe_layer_flags()) else 0
    return "fused" if f"model.layers.{first}.mlp.experts.gate_up_proj" in names else "legacy"


def _moe_prefix(cfg: MoeConfig, layout: str) -> str:
    return "block_sparse_moe" if cfg.model_type == "mixtral" and layout == "legacy" else "mlp"


def hf_expert_shapes(cfg: MoeConfig, names: Container[str]) -> dict[str, tuple[int, ...]]:
    """The HF MLP tensors (name -> HF shape) of every layer, in the layout ``names`` holds.

    Args:
        cfg: the config.
        names: the checkpoint's tensor names (a container supporting ``in``).
    """
    e, f, fm, x = cfg.hidden_size, cfg.intermediate_size, cfg.moe_intermediate_size, cfg.num_experts
    layout = _layout(cfg, names)
    out: dict[str, tuple[int, ...]] = {}
    for i, sparse in enumerate(cfg.moe_layer_flags()):
        p = f"model.layers.{i}."
        if not sparse:
            out.update({p + "mlp.gate_proj.weight": (f, e), p + "mlp.up_proj.weight": (f, e)})
            out[p + "mlp.down_proj.weight"] = (e, f)
            continue
        pre = p + _moe_prefix(cfg, layout) + "."
        out[pre + "gate.weight"] = (x, e)
        if layout == "fused":
            out[pre + "experts.gate_up_proj"] = (x, 2 * fm, e)
            out[pre + "experts.down_proj"] = (x, e, fm)
            continue
        col = 0 if cfg.model_type == "mixtral" else 1
        for j in range(x):
            for ours, legacy in _LEGACY.items():
                shape = (e, fm) if ours == "expert_down" else (fm, e)
                out[f"{pre}experts.{j}.{legacy[col]}.weight"] = shape
    return out


def expert_sources(
    cfg: MoeConfig, names: Container[str] = ()
) -> dict[tuple[str, ...], TensorSource]:
    """The loader's table entries of the MLP parameters (:func:`paxcache.models.loading.
    hf_sources`), in the layout ``names`` holds; the sharded loader reads each device's block
    of them straight into its ``ep`` / ``tp`` shard (:func:`paxcache.sharding.expert_specs`).

    Our stacks run over the sparse layers (``router``, ``expert_*``: [Lm, ...]) or the dense
    ones (``*_proj``: [Ld, ...]); each source's ``layers`` maps a stack entry to its checkpoint
    layer. Legacy experts are one tensor per expert (``{expert}``, [Fm, E] / [E, Fm]); fused
    ones are 3-D ``gate_up_proj`` [X, 2Fm, E] (gate rows, then up) and ``down_proj``
    [X, E, Fm], transposed on their last two axes.

    Args:
        cfg: the config.
        names: the checkpoint's tensor names (default: the legacy layout).
    """
    flags = cfg.moe_layer_flags()
    sparse = tuple(i for i, s in enumerate(flags) if s)
    dense = tuple(i for i, s in enumerate(flags) if not s)
    layer = f"model.layers.{LAYER}."
    out: dict[tuple[str, ...], TensorSource] = {}
    if dense:
        for n in ("gate_proj", "up_proj", "down_proj"):
            out["layers", n] = TensorSource(f"{layer}mlp.{n}.weight", True, layers=dense)
    if not sparse:
        return out
    layout = _layout(cfg, names)
    pre = layer + _moe_prefix(cfg, layout) + "."
    out["layers", "router"] = TensorSource(pre + "gate.weight", True, layers=sparse)
    if layout == "fused":
        fm = cfg.moe_intermediate_size
        gate_up = pre + "experts.gate_up_proj"
        out["layers", "expert_gate"] = TensorSource(gate_up, True, (0, fm), layers=sparse)
        out["layers", "expert_up"] = TensorSource(gate_up, True, (fm, 2 * fm), layers=sparse)
        out["layers", "expert_down"] = TensorSource(pre + "experts.down_proj", True, layers=sparse)
        return out
    col = 0 if cfg.model_type == "mixtral" else 1
    for ours, legacy in _LEGACY.items():
        name = f"{pre}experts.{EXPERT}.{legacy[col]}.weight"
        out["layers", ours] = TensorSource(name, True, layers=sparse)
    return out


def moe_hf_tensors(model: MoeForCausalLM) -> dict[str, np.ndarray]:
    """The MLP parameters as HF tensors in the legacy per-expert layout (what transformers'
    ``save_pretrained`` writes)."""
    cfg, layers = model.config, model.layers
    arrays = {
        n: np.asarray(getattr(layers, n)[...])
        for n in MoeLayers.MLP_NAMES
        if getattr(layers, n) is not None
    }
    out: dict[str, np.ndarray] = {}
    pre_name = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
    col = 0 if cfg.model_type == "mixtral" else 1
    sparse_i = dense_i = 0
    for i, sparse in enumerate(cfg.moe_layer_flags()):
        p = f"model.layers.{i}."
        if not sparse:
            for n in ("gate_proj", "up_proj", "down_proj"):
                out[f"{p}mlp.{n}.weight"] = np.ascontiguousarray(arrays[n][dense_i].T)
            dense_i += 1
            continue
        pre = f"{p}{pre_name}."
        out[pre + "gate.weight"] = np.ascontiguousarray(arrays["router"][sparse_i].T)
        for j in range(cfg.num_experts):
            for ours, legacy in _LEGACY.items():
                w = arrays[ours][sparse_i, j].T
                out[f"{pre}experts.{j}.{legacy[col]}.weight"] = np.ascontiguousarray(w)
        sparse_i += 1
    return out
