"""A Llama-family decoder in Flax NNX: Llama 2/3, Mistral, Qwen2, Qwen3, OLMo 2 and Phi-3 from
one code path (what differs per family is a few config flags: :mod:`paxcache.models.families`).

Shape letters: B batch, T tokens, E hidden size, F intermediate size, H query heads,
K kv heads, D head dim, L layers, V vocabulary, N blocks, S block size.

Per-layer weights are stacked with a leading ``[L]`` axis and the layers run under
``jax.lax.scan``, so compile time does not grow with depth. Linear weights are stored as
``[in, out]`` (the transpose of HF's ``nn.Linear.weight``). q/k projections keep HF's
*rotate-half* RoPE convention (the first and second halves of each head are the two
rotation coordinates), so HF checkpoints load without permuting rows.

Two forward paths share the per-layer code:

* ``model(token_ids)``: the dense causal forward with no cache (the reference).
* ``model.forward_paged(token_ids, kv_cache, metadata)``: a flat (ragged) batch of tokens whose
  attention and KV writes go through the model's own :class:`paxcache.nn.PagedAttention`
  layer, the same layer a user's model calls (README, "Paged attention in your own Flax
  model"). The step's :class:`~paxcache.attention.AttentionMetadata` gives the positions, the
  block tables and how the op runs (kernel, mesh); the KV cache travels through the scan carry
  so XLA can update them in place.

Numerics: parameters are stored in ``param_dtype``; matmuls run in ``dtype`` with float32
accumulation; RMSNorm statistics, RoPE, softmax and logits are float32.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

import kernels_pallas as kp
from paxcache.attention import AttentionMetadata
from paxcache.models.layer_plan import LayerAttention, run_layers
from paxcache.models.llama_config import (  # re-exported: the model's configuration
    NO_WINDOW,
    SUPPORTED_MODEL_TYPES,
    ConfigError,
    LlamaConfig,
    rope_attention_scaling,
    rope_inv_freq,
)
from paxcache.nn import PagedAttention

__all__ = [
    "NO_WINDOW",
    "SUPPORTED_MODEL_TYPES",
    "ConfigError",
    "LlamaConfig",
    "LlamaForCausalLM",
    "LlamaLayers",
    "apply_rope",
    "dense_attention",
    "greedy_generate",
    "rms_norm",
    "rope_cos_sin",
]

# ------------------------------------------------------------------------------------------
# Building blocks (pure functions over arrays)
# ------------------------------------------------------------------------------------------


def _is_longrope(cfg: LlamaConfig) -> bool:
    rs = cfg.rope_scaling
    return bool(rs) and rs.get("rope_type", rs.get("type")) in ("longrope", "su")


def rope_cos_sin(
    cfg: LlamaConfig, positions: jax.Array, seq_lens: jax.Array | None = None
) -> tuple[jax.Array, jax.Array]:
    """RoPE tables for the rotate-half convention.

    Longrope (Phi-3) follows HF's rule: a sequence longer than
    ``original_max_position_embeddings`` uses the long factors for every token of the forward,
    a shorter one the short factors; cos and sin are scaled by the attention factor. Here the
    rule is applied per sequence (HF takes the batch's longest), so batching does not change a
    sequence's result.

    The paged path (:meth:`LlamaForCausalLM.hidden_states_paged`) decides from each
    sequence's whole known length (``AttentionMetadata.rope_lens``: a prompt's later chunks
    included), so every chunk of a long prompt takes the long factors as HF's one forward
    does; a sequence that grows past the original length while decoding is recomputed by the
    engine's scheduler (``LlamaConfig.rope_switch_len``), as HF's ``generate`` drops its
    cache there (``Phi3ForCausalLM.prepare_inputs_for_generation``).

    Args:
        cfg: the config.
        positions: i32[...] token positions.
        seq_lens: optional i32[...] (broadcastable to ``positions``), the length of each
            token's sequence in this forward (for the longrope switch only). Default: the
            largest position along the last axis, plus one.

    Returns:
        cos, sin: f32[..., R] (each frequency repeated for both halves; R = D unless
        ``partial_rotary_factor`` < 1).
    """
    inv_freq = rope_inv_freq(cfg)
    ang = positions.astype(jnp.float32)[..., None] * inv_freq  # [..., R/2]
    if _is_longrope(cfg):
        if seq_lens is None:
            seq_lens = jnp.max(positions, axis=-1, keepdims=True) + 1
        orig = cfg.rope_scaling["original_max_position_embeddings"]
        is_long = (jnp.asarray(seq_lens) > orig)[..., None]
        long_ang = positions.astype(jnp.float32)[..., None] * rope_inv_freq(cfg, long=True)
        ang = jnp.where(is_long, long_ang, ang)
    ang = jnp.concatenate([ang, ang], axis=-1)
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    scale = rope_attention_scaling(cfg)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotates ``x: [..., T, heads, D]`` by ``cos/sin: [..., T, R]`` (HF rotate-half).

    With R < D (partial rotary) only the first R dims of each head rotate; the rest pass.
    """
    r = cos.shape[-1]
    if r < x.shape[-1]:
        return jnp.concatenate([apply_rope(x[..., :r], cos, sin), x[..., r:]], axis=-1)
    xf = x.astype(jnp.float32)
    half = x.shape[-1] // 2
    rot = jnp.concatenate([-xf[..., half:], xf[..., :half]], axis=-1)
    out = xf * cos[..., None, :] + rot * sin[..., None, :]
    return out.astype(x.dtype)


def rms_norm(
    x: jax.Array,
    weight: jax.Array,
    eps: float,
    weight_in_f32: bool = False,
    offset: float = 0.0,
) -> jax.Array:
    """RMSNorm over the last axis with float32 statistics; returns ``x.dtype``.

    Args:
        x: [..., N]; weight: [N].
        eps: epsilon.
        weight_in_f32: scale in float32, then cast (HF OLMo 2, Gemma); default: cast, then
            scale (HF Llama). The same in float32.
        offset: scale by ``offset + weight`` (Gemma's ``1 + w``, added in float32).
    """
    xf = x.astype(jnp.float32)
    y = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    w = weight.astype(jnp.float32) + offset if offset else weight
    if weight_in_f32:
        return (w.astype(jnp.float32) * y).astype(x.dtype)
    return w.astype(x.dtype) * y.astype(x.dtype)  # HF order: cast, then scale


def _dense(x: jax.Array, w: jax.Array, b: jax.Array | None, dtype: Any) -> jax.Array:
    y = jnp.einsum(
        "...i,io->...o", x.astype(dtype), w.astype(dtype), preferred_element_type=jnp.float32
    )
    if b is not None:
        y = y + b.astype(jnp.float32)
    return y.astype(dtype)


def dense_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    q_pos: jax.Array,
    k_pos: jax.Array,
    window: jax.Array | int,
    k_valid: jax.Array | None = None,
    *,
    sm_scale: float | None = None,
    soft_cap: float | None = None,
    sinks: jax.Array | None = None,
) -> jax.Array:
    """Causal (optionally windowed) GQA attention over explicit positions.

    Args:
        q: [B, T, H, D] queries (RoPE applied, not pre-scaled).
        k, v: [B, S, K, D].
        q_pos: i32[B, T]; k_pos: i32[B, S] positions.
        window: i32 scalar; query at p sees keys at p - window < pos <= p.
            Use ``NO_WINDOW`` for full causal attention.
        k_valid: optional bool[B, S]; False keys are never attended.
        sm_scale: logit scale (default ``D ** -0.5``); soft_cap: optional logit soft cap
            (``cap * tanh(logits / cap)``, after the scale), as the paged kernels.
        sinks: optional f32[H] attention sinks (gpt-oss): one logit per query head that
            joins the softmax denominator only.

    Returns:
        [B, T, H, D] in q's dtype. Softmax is float32. A query with no visible key
        returns zeros.
    """
    b, t, h, d = q.shape
    kh = k.shape[2]
    g = h // kh
    qg = q.reshape(b, t, kh, g, d)
    scores = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (d**-0.5 if sm_scale is None else sm_scale)
    if soft_cap is not None:
        scores = soft_cap * jnp.tanh(scores / soft_cap)
    qp = q_pos[:, :, None]
    kp = k_pos[:, None, :]
    mask = (kp <= qp) & (kp > qp - window)  # [B, T, S]
    if k_valid is not None:
        mask = mask & k_valid[:, None, :]
    scores = jnp.where(mask[:, None, None], scores, -jnp.inf)
    m = jnp.max(scores, axis=-1, keepdims=True)
    sink = None if sinks is None else sinks.astype(jnp.float32).reshape(1, kh, g, 1, 1)
    if sink is not None:
        m = jnp.maximum(m, sink)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(scores - m)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - m)
    p = p / jnp.where(denom == 0, 1.0, denom)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, d).astype(q.dtype)


# ------------------------------------------------------------------------------------------
# NNX modules
# ------------------------------------------------------------------------------------------


class LlamaLayers(nnx.Module):
    """All decoder layers' weights, stacked on a leading ``[L]`` axis.

    Attributes (shapes; linear weights are ``[in, out]``; None where the config has none):
        input_layernorm: [L, E] ("pre", "sandwich");  post_attention_layernorm: [L, E]
            (before the MLP when "pre", on the attention output when "post" / "sandwich")
        pre_feedforward_layernorm: [L, E] (before the MLP; "sandwich" only)
        post_feedforward_layernorm: [L, E] (on the MLP output; "post", "sandwich")
        q_proj: [L, E, H*D]; k_proj, v_proj: [L, E, K*D]; o_proj: [L, H*D, E]
        q_bias: [L, H*D]; k_bias, v_bias: [L, K*D] (when ``qkv_bias``); o_bias: [L, E]
        q_norm, k_norm: [L, D] (``qk_norm="head"``) or [L, H*D], [L, K*D] ("full")
        gate_proj, up_proj: [L, E, F]; down_proj: [L, F, E]
    """

    def __init__(self, cfg: LlamaConfig, *, param_dtype: Any, rngs: nnx.Rngs) -> None:
        n, e, f = cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size
        hd, kd = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        init = jax.nn.initializers.normal(0.02)

        def w(*shape: int) -> nnx.Param:
            return nnx.Param(init(rngs.params(), shape, jnp.float32).astype(param_dtype))

        def ones(*shape: int) -> nnx.Param:
            return nnx.Param(jnp.ones(shape, param_dtype))

        def zeros(*shape: int) -> nnx.Param:
            return nnx.Param(jnp.zeros(shape, param_dtype))

        placement = cfg.norm_placement
        norm = zeros if cfg.norm_offset else ones  # Gemma's 1 + w starts at w = 0
        self.input_layernorm = None if placement == "post" else norm(n, e)
        self.post_attention_layernorm = norm(n, e)
        self.pre_feedforward_layernorm = norm(n, e) if placement == "sandwich" else None
        self.post_feedforward_layernorm = None if placement == "pre" else norm(n, e)
        self.q_proj = w(n, e, hd)
        self.k_proj = w(n, e, kd)
        self.v_proj = w(n, e, kd)
        self.o_proj = w(n, hd, e)
        self.q_bias = zeros(n, hd) if cfg.qkv_bias else None
        self.k_bias = zeros(n, kd) if cfg.qkv_bias else None
        self.v_bias = zeros(n, kd) if cfg.qkv_bias else None
        self.o_bias = zeros(n, e) if cfg.o_bias else None
        qn, kn = {"none": (0, 0), "head": (cfg.head_dim, cfg.head_dim), "full": (hd, kd)}[
            cfg.qk_norm
        ]
        self.q_norm = norm(n, qn) if qn else None
        self.k_norm = norm(n, kn) if kn else None
        self.gate_proj = w(n, e, f)
        self.up_proj = w(n, e, f)
        self.down_proj = w(n, f, e)

    PARAM_NAMES = (
        "input_layernorm",
        "post_attention_layernorm",
        "pre_feedforward_layernorm",
        "post_feedforward_layernorm",
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "q_bias",
        "k_bias",
        "v_bias",
        "o_bias",
        "q_norm",
        "k_norm",
        "gate_proj",
        "up_proj",
        "down_proj",
    )

    def stacked(self) -> dict[str, jax.Array]:
        """The stacked arrays as a dict (None-valued biases omitted), for ``lax.scan`` xs."""
        out = {}
        for name in self.PARAM_NAMES:
            p = getattr(self, name)
            if p is not None:
                out[name] = p[...]
        return out


class LlamaForCausalLM(nnx.Module):
    """Llama-family causal LM (Llama 2/3, Mistral, Qwen2, Qwen3, OLMo 2, Phi-3).

    Example:
        >>> model = LlamaForCausalLM(cfg, rngs=nnx.Rngs(0))
        >>> logits = model(jnp.zeros((1, 8), jnp.int32))  # f32[1, 8, V]

    Attributes:
        config: the LlamaConfig.
        dtype: compute dtype for matmuls and activations.
        embed_tokens: [V, E].
        layers: LlamaLayers (stacked [L, ...] weights).
        norm: [E] final RMSNorm weight.
        lm_head: [E, V], or None when embeddings are tied.
        attention: the paged attention layer of the first layer (no weights; built with
            the model's heads, head dim and the layer's :class:`LayerAttention` options);
            layers of another kind get their own (:meth:`paged_attention`).
    """

    def __init__(
        self,
        config: LlamaConfig,
        *,
        dtype: Any = jnp.float32,
        param_dtype: Any | None = None,
        rngs: nnx.Rngs,
    ) -> None:
        param_dtype = dtype if param_dtype is None else param_dtype
        self.config = config
        self.dtype = jnp.dtype(dtype)
        e, v = config.hidden_size, config.vocab_size
        init = jax.nn.initializers.normal(0.02)
        self.embed_tokens = nnx.Param(init(rngs.params(), (v, e), jnp.float32).astype(param_dtype))
        self.layers = LlamaLayers(config, param_dtype=param_dtype, rngs=rngs)
        self.norm = nnx.Param(jnp.ones((e,), param_dtype))
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nnx.Param(init(rngs.params(), (e, v), jnp.float32).astype(param_dtype))
        self.attention = self.paged_attention(config.layer_attention()[0])

    # -- shared per-layer pieces -----------------------------------------------------------

    def paged_attention(self, kind: LayerAttention) -> PagedAttention:
        """The paged attention layer for layers of ``kind`` (the model's heads and head dim)."""
        cfg = self.config
        return PagedAttention(
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            sm_scale=kind.sm_scale,
            soft_cap=kind.soft_cap,
            sliding_window=kind.sliding_window,
        )

    def rope_tables(
        self, positions: jax.Array, seq_lens: jax.Array | None = None
    ) -> dict[str, tuple[jax.Array, jax.Array]]:
        """RoPE name (:attr:`LayerAttention.rope`) -> (cos, sin) of :func:`rope_cos_sin`."""
        return {"default": rope_cos_sin(self.config, positions, seq_lens)}

    def _attention_kwargs(self, lp: Mapping[str, jax.Array]) -> dict[str, jax.Array]:
        """Per-layer array options of the attention call (gpt-oss: ``sinks``); none here."""
        del lp
        return {}

    def _norm(self, x: jax.Array, weight: jax.Array) -> jax.Array:
        """RMSNorm over the last axis in this family's order (see :func:`rms_norm`)."""
        cfg = self.config
        return rms_norm(x, weight, cfg.rms_norm_eps, cfg.norm_weight_f32, cfg.norm_offset)

    def _qkv(
        self, lp: Mapping[str, jax.Array], x: jax.Array, cos: jax.Array, sin: jax.Array
    ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(Pre-norm +) q/k/v projection (+ q/k norm) + RoPE for one layer.

        Args:
            lp: one layer's params (the ``[L]`` axis removed).
            x: [..., T, E] residual stream.
            cos, sin: [..., T, R].

        Returns:
            q: [..., T, H, D], k and v: [..., T, K, D] in the compute dtype.
        """
        cfg, dt = self.config, self.dtype
        h = x if cfg.norm_placement == "post" else self._norm(x, lp["input_layernorm"])
        q = _dense(h, lp["q_proj"], lp.get("q_bias"), dt)
        k = _dense(h, lp["k_proj"], lp.get("k_bias"), dt)
        v = _dense(h, lp["v_proj"], lp.get("v_bias"), dt)
        if cfg.qk_norm == "full":  # over the whole projection [H*D] / [K*D] (OLMo 2)
            q, k = self._norm(q, lp["q_norm"]), self._norm(k, lp["k_norm"])
        lead = x.shape[:-1]
        q = q.reshape(*lead, cfg.num_attention_heads, cfg.head_dim)
        k = k.reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        v = v.reshape(*lead, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm == "head":  # over each head's D (Qwen3)
            q, k = self._norm(q, lp["q_norm"]), self._norm(k, lp["k_norm"])
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _finish_layer(
        self, lp: Mapping[str, jax.Array], x: jax.Array, attn: jax.Array
    ) -> jax.Array:
        """Output projection, residual, MLP block for one layer.

        Args:
            x: [..., T, E] residual stream before this layer.
            attn: [..., T, H, D] attention output.

        Returns:
            [..., T, E] residual stream after this layer.
        """
        cfg, dt = self.config, self.dtype
        post = cfg.norm_placement == "post"
        attn = attn.reshape(*attn.shape[:-2], cfg.num_attention_heads * cfg.head_dim)
        o = _dense(attn, lp["o_proj"], lp.get("o_bias"), dt)
        x = x + (self._norm(o, lp["post_attention_layernorm"]) if post else o)
        h = x if post else self._norm(x, lp["post_attention_layernorm"])
        mlp = self._mlp(lp, h)
        return x + (self._norm(mlp, lp["post_feedforward_layernorm"]) if post else mlp)

    def _mlp(
        self, lp: Mapping[str, jax.Array], h: jax.Array, act: Callable = jax.nn.silu
    ) -> jax.Array:
        """Gated MLP ``down(act(gate(h)) * up(h))``, the gate in float32: [..., E] -> [..., E]."""
        dt = self.dtype
        gate = _dense(h, lp["gate_proj"], None, dt)
        up = _dense(h, lp["up_proj"], None, dt)
        a = (act(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(dt)
        return _dense(a, lp["down_proj"], None, dt)

    def embed(self, token_ids: jax.Array) -> jax.Array:
        """i32[...] -> [..., E] embeddings in the compute dtype."""
        return jnp.take(self.embed_tokens[...], token_ids, axis=0).astype(self.dtype)

    def compute_logits(self, hidden: jax.Array) -> jax.Array:
        """Final-normed hidden states [..., E] -> f32[..., V] logits."""
        w = self.embed_tokens[...].T if self.lm_head is None else self.lm_head[...]
        return jnp.einsum(
            "...e,ev->...v",
            hidden.astype(self.dtype),
            w.astype(self.dtype),
            preferred_element_type=jnp.float32,
        )

    # -- dense reference -------------------------------------------------------------------

    def hidden_states(
        self,
        token_ids: jax.Array,
        positions: jax.Array | None = None,
        seq_lens: jax.Array | None = None,
    ) -> jax.Array:
        """Dense causal forward up to the final norm.

        Args:
            token_ids: i32[B, T].
            positions: optional i32[B, T]; defaults to ``arange(T)``. Attention is causal in
                position order (key position <= query position, within the window).
            seq_lens: optional i32[B] real length of each row (right padding excluded); only
                longrope RoPE reads it (default: the largest position + 1).

        Returns:
            [B, T, E] final-normed hidden states in the compute dtype.
        """
        token_ids = jnp.asarray(token_ids)
        if token_ids.ndim != 2:
            raise ValueError(f"token_ids must be i32[B, T], got shape {token_ids.shape}")
        b, t = token_ids.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
        if seq_lens is not None:
            seq_lens = jnp.asarray(seq_lens)[:, None]
        ropes = self.rope_tables(positions, seq_lens)
        x = self.embed(token_ids)

        def body(x, lp, layer, kind: LayerAttention):
            q, k, v = self._qkv(lp, x, *ropes[kind.rope])
            window = NO_WINDOW if kind.sliding_window is None else kind.sliding_window
            attn = dense_attention(
                q,
                k,
                v,
                positions,
                positions,
                window,
                sm_scale=kind.sm_scale,
                soft_cap=kind.soft_cap,
                **self._attention_kwargs(lp),
            )
            return self._finish_layer(lp, x, attn)

        x = run_layers(body, x, self.layers.stacked(), self.config.layer_attention())
        return self._norm(x, self.norm[...])

    def __call__(
        self,
        token_ids: jax.Array,
        positions: jax.Array | None = None,
        seq_lens: jax.Array | None = None,
    ) -> jax.Array:
        """Dense causal forward with no cache: i32[B, T] -> f32[B, T, V] logits.

        ``positions`` and ``seq_lens`` as in :meth:`hidden_states`.
        """
        return self.compute_logits(self.hidden_states(token_ids, positions, seq_lens))

    # -- paged path ------------------------------------------------------------------------

    def hidden_states_paged(
        self,
        token_ids: jax.Array,
        kv_cache: Any,
        metadata: AttentionMetadata,
    ) -> tuple[jax.Array, Any]:
        """Flat-batch forward on the paged KV cache, up to the final norm.

        Args:
            token_ids: i32[T] tokens of all sequences in the step, flattened (row order of
                ``metadata``).
            kv_cache: the whole model's KV cache (a :class:`kernels_pallas.PagedKVCache`,
                opaque here: it is handed to each layer's attention and carried through the
                layer scan so XLA updates it in place).
            metadata: the step's attention metadata; ``metadata.positions`` drives RoPE.

        Returns:
            (hidden [T, E] final-normed, the cache with this step's K/V written).

        Layers of different kinds (windows, soft caps, scales, RoPE tables:
        ``config.layer_attention()``) each call the attention op with their own static
        options, laid out by :func:`paxcache.models.layer_plan.run_layers`.
        """
        positions = metadata.positions
        # Longrope switches on each sequence's whole known length (HF's rule per forward).
        lens = metadata.kv_lens if metadata.rope_lens is None else metadata.rope_lens
        seq_lens = jnp.take(lens, metadata.row_seq)
        ropes = self.rope_tables(positions, seq_lens)
        x = self.embed(token_ids)
        kinds = self.config.layer_attention()
        layers = {kind: self.paged_attention(kind) for kind in set(kinds)}
        layers[kinds[0]] = self.attention

        def body(carry, lp, layer, kind: LayerAttention):
            x, kv_cache = carry
            q, k, v = self._qkv(lp, x, *ropes[kind.rope])
            extra = self._attention_kwargs(lp)
            attn, kv_cache = layers[kind](q, k, v, kv_cache, metadata, layer=layer, **extra)
            return self._finish_layer(lp, x, attn), kv_cache

        x, kv_cache = run_layers(body, (x, kv_cache), self.layers.stacked(), kinds)
        return self._norm(x, self.norm[...]), kv_cache

    def forward_paged(
        self,
        token_ids: jax.Array,
        kv_cache: Any,
        metadata: AttentionMetadata,
        logits_indices: jax.Array | None = None,
    ) -> tuple[jax.Array, Any]:
        """Paged forward: :meth:`hidden_states_paged` plus the LM head.

        Args:
            token_ids, kv_cache, metadata: as in :meth:`hidden_states_paged`.
            logits_indices: optional i32[R] rows of the flat batch to compute logits for
                (e.g. each sequence's last token); all T rows when None.

        Returns:
            (logits f32[T or R, V], the updated cache).
        """
        hidden, kv_cache = self.hidden_states_paged(token_ids, kv_cache, metadata)
        if logits_indices is not None:
            hidden = jnp.take(hidden, logits_indices, axis=0)
        return self.compute_logits(hidden), kv_cache

    def init_kv_cache(
        self,
        num_blocks: int,
        block_size: int,
        dtype: Any | None = None,
        *,
        fill_value: float = 0.0,
    ) -> kp.PagedKVCache:
        """A KV cache for every layer (``kp.init_kv_cache``), in ``dtype`` (default: compute)."""
        cfg = self.config
        return kp.init_kv_cache(
            cfg.num_hidden_layers,
            num_blocks,
            block_size,
            cfg.num_key_value_heads,
            cfg.head_dim,
            self.dtype if dtype is None else dtype,
            fill_value=fill_value,
        )


_NEXT_TOKEN_FNS: dict[Any, Callable[..., jax.Array]] = {}


def _next_token_fn(graphdef: Any) -> Callable[..., jax.Array]:
    fn = _NEXT_TOKEN_FNS.get(graphdef)
    if fn is None:

        @jax.jit
        def fn(state, ids, n):
            logits = nnx.merge(graphdef, state)(ids[None], seq_lens=n[None])[0]
            return jnp.argmax(logits[n - 1]).astype(jnp.int32)

        _NEXT_TOKEN_FNS[graphdef] = fn
    return fn


def greedy_generate(
    model: LlamaForCausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
) -> list[int]:
    """Greedy decoding with the dense path (no cache; for tests and demos, O(T^2) per token).

    The running sequence is padded to a power-of-two bucket (causal attention makes the
    padding invisible), so only a few shapes compile; compiled steps are cached per model
    structure.

    Returns:
        The generated ids (not including the prompt), ending at the first stop id if any.
    """
    if not prompt_ids:
        raise ValueError("greedy_generate needs a non-empty prompt")
    graphdef, state = nnx.split(model)
    next_token = _next_token_fn(graphdef)
    ids = [int(i) for i in prompt_ids]
    out: list[int] = []
    for _ in range(max_new_tokens):
        n = len(ids)
        bucket = max(16, 1 << (n - 1).bit_length())
        padded = jnp.asarray(ids + [0] * (bucket - n), jnp.int32)
        tok = int(next_token(state, padded, n))
        out.append(tok)
        ids.append(tok)
        if tok in stop_ids:
            break
    return out
