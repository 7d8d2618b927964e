"""The Pallas Triton attention kernel (``kernels_pallas.gpu.triton_attention``): compute
capability 8.0 and newer outside Hopper; on Hopper the ragged op (the Mosaic GPU ragged kernel
failed its oracle on an H200) and the decode geometries the Mosaic GPU kernel refuses.

* Interpreted on this CPU against ``kernels_pallas.reference``: ragged batches whose decode and
  prefill rows come in any order, stacked token-major layers (``[L, N, S, C, P, D]``,
  ``kernels_pallas.kv_layout``), every unwritten slot NaN and block-table entries past each
  sequence's length pointing at a NaN page (or -1), GQA with G from 1 to 8 (3 too: no power
  of two), 8-bit pages with their scales (odd K: a dummy head, poisoned), sinks, soft cap,
  sliding window, forced KV splits.
* Lowered for CUDA with ``aot.cuda_target`` (no GPU): 8.0, 8.9 and 10.0 export the Triton call
  for both ops, 9.0 for the ragged op (decode: the Mosaic GPU kernel);
  ``impl="pallas_triton"`` forces it.

Tiny shapes: the whole file runs in well under a minute on two cores; ``-m slow`` adds the
wide export grid.
"""

from __future__ import annotations

import functools
import itertools
import warnings

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kernels_pallas as kp
from kernels_pallas import _dispatch, aot, compat, reference
from kernels_pallas.attention import paged_attention_pages, ragged_paged_attention_pages
from kernels_pallas.gpu import triton_attention as ta
from kernels_pallas.kv_layout import merge_kv

TRITON = compat.TRITON_CALL_TARGET
MOSAIC_GPU = "custom_call @mosaic_gpu"
LAYERS, LAYER = 2, 1


@pytest.fixture(autouse=True)
def quiet(monkeypatch):
    monkeypatch.setattr(_dispatch, "_WARNED", set())
    with warnings.catch_warnings():  # JAX 0.12's Triton lowering: deprecation (see compat)
        warnings.simplefilter("ignore", DeprecationWarning)
        yield


# --------------------------------------------------------------------------------------------
# Cases: stacked NaN-poisoned pages, junk table entries past each length
# --------------------------------------------------------------------------------------------


def _case(rng, q_lens, kv_lens, num_seqs, t, *, g, kh=2, d=16, s=8, m=4, dtype=jnp.float32):
    """A ragged batch over ``[L, N, S, C, P, D]`` pages: layer ``LAYER`` holds each sequence's
    keys; every other slot, page and layer is NaN. Entries past a sequence's last block point
    at the NaN page ``N - 1`` (even rows) or are -1 (odd rows). ``k`` / ``v``: the same K
    and V head-major, ``[L, N, S, K, D]`` in float32 (``kv`` merges them in ``dtype``)."""
    b = len(q_lens)
    n = b * m + 2
    poison = n - 1
    tables = rng.permutation(n - 1)[: b * m].reshape(b, m).astype(np.int32)
    k = np.full((LAYERS, n, s, kh, d), np.nan, np.float32)
    v = np.full((LAYERS, n, s, kh, d), np.nan, np.float32)
    for i, length in enumerate(kv_lens):
        used = -(-length // s) if i < num_seqs else 0
        tables[i, used:] = poison if i % 2 == 0 else -1
        for p in range(length if i < num_seqs else 0):
            blk, off = tables[i, p // s], p % s
            k[LAYER, blk, off] = rng.normal(size=(kh, d))
            v[LAYER, blk, off] = rng.normal(size=(kh, d))
    cu = np.zeros(b + 1, np.int32)
    cu[1 : num_seqs + 1] = np.cumsum(q_lens[:num_seqs])
    cu[num_seqs + 1 :] = cu[num_seqs]
    q = rng.normal(size=(t, kh * g, d))
    return dict(
        q=jnp.asarray(q, dtype), kv=merge_kv(jnp.asarray(k, dtype), jnp.asarray(v, dtype)),
        k=k, v=v, kh=kh, kv_lens=jnp.asarray(kv_lens, jnp.int32), tables=jnp.asarray(tables),
        cu=jnp.asarray(cu), num_seqs=num_seqs,
    )  # fmt: skip


def _ragged_oracle(c, **kw):
    return reference.ragged_paged_attention_reference(
        c["q"], c["kv"][LAYER], c["kv_lens"], c["tables"], c["cu"], c["num_seqs"],
        num_kv_heads=c["kh"], **kw,
    )  # fmt: skip


def _ragged_triton(c, **kw):
    return ragged_paged_attention_pages(
        c["q"], c["kv"], c["kv_lens"], c["tables"], c["cu"], c["num_seqs"],
        num_kv_heads=c["kh"], impl="pallas_triton", interpret=True, layer=LAYER, **kw,
    )  # fmt: skip


def _check(out, want, dtype):
    out, want = np.asarray(out, np.float32), np.asarray(want, np.float32)
    assert np.isfinite(out).all(), "NaN / inf reached the output"
    tol = 2e-5 if dtype == jnp.float32 else 2e-2
    chex.assert_trees_all_close(out, want, atol=tol, rtol=tol)


# --------------------------------------------------------------------------------------------
# Interpreted kernel vs the oracle
# --------------------------------------------------------------------------------------------


@settings(max_examples=4, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@given(
    order=st.permutations([1, 1, 1, 6, 3, 0]),
    kv_extra=st.lists(st.integers(0, 20), min_size=6, max_size=6),
)
def test_ragged_rows_of_decodes_and_prefills_in_any_order_match_the_oracle(order, kv_extra):
    """Decode rows (q_len 1), prefill chunks and an empty sequence in random order (fixed
    shapes: the interpreted kernel is traced once), G = 3, stacked layer 1."""
    rng = np.random.default_rng(sum(kv_extra))
    q_lens = np.asarray(order, np.int32)
    kv_lens = q_lens + np.asarray(kv_extra, np.int32)  # prefix-cache hits and chunks
    c = _case(rng, q_lens, kv_lens, 5, 16, g=3)  # the sixth sequence is padding
    _check(_ragged_triton(c), _ragged_oracle(c), jnp.float32)


# (G, D, S, dtype, options): G from 1 to 8, head_dim 16..64, block sizes 4..16.
FAST = [
    pytest.param(
        1, 32, 4, jnp.bfloat16, dict(soft_cap=5.0, sliding_window=7), id="g1-bf16-cap-win"
    ),
    pytest.param(8, 16, 16, jnp.float16, dict(sinks=True), id="g8-f16-sinks"),
    pytest.param(5, 64, 8, jnp.float32, dict(num_splits=3), id="g5-f32-3splits"),
]


def _options(opts, h, rng):
    opts = dict(opts)
    if opts.pop("sinks", False):
        opts["sinks"] = jnp.asarray(rng.normal(size=(h,)), jnp.float32)
    return opts


@pytest.mark.parametrize("g,d,s,dtype,opts", FAST)
def test_ragged_and_decode_match_the_oracle_on_poisoned_pages(g, d, s, dtype, opts):
    rng = np.random.default_rng(g)
    q_lens, kv_lens = np.array([5, 1, 9, 1]), np.array([5, 30, 12, 1])
    c = _case(rng, q_lens, kv_lens, 4, 18, g=g, d=d, s=s, m=-(-30 // s), dtype=dtype)
    opts = _options(opts, c["q"].shape[1], rng)
    splits = opts.pop("num_splits", None)
    oracle = {k: v for k, v in opts.items()}
    if splits is None:
        out = _ragged_triton(c, **opts)
    else:  # the kernel module itself: exactly `splits` KV splits per live tile
        out = ta.ragged_paged_attention_triton(
            c["q"], c["kv"], c["kv_lens"], c["tables"], c["cu"], c["num_seqs"],
            num_kv_heads=c["kh"], sm_scale=d**-0.5, interpret=True, num_splits=splits,
            layer=LAYER, **opts,
        )  # fmt: skip
    _check(out, _ragged_oracle(c, **oracle), dtype)

    # Decode: one row per sequence at lengths - 1 (0 = padding row, output zeros).
    lengths = jnp.asarray([5, 30, 0, 1], jnp.int32)
    q = c["q"][:4]
    out = paged_attention_pages(
        q, c["kv"], lengths, c["tables"], num_kv_heads=c["kh"], impl="pallas_triton",
        interpret=True, layer=LAYER, **opts,
    )  # fmt: skip
    want = reference.paged_attention_reference(
        q, c["kv"][LAYER], lengths, c["tables"], num_kv_heads=c["kh"], **oracle
    )
    _check(out, want, dtype)
    assert not np.asarray(out[2], np.float32).any()  # the padding row


@pytest.mark.parametrize("kv_dtype", [jnp.int8, jnp.float8_e4m3fn])
def test_8bit_pages_are_dequantized_in_the_kernel_with_the_layer_scales(kv_dtype):
    """int8 / float8 pages: the kernel's output equals the dequantizing oracle's (bf16
    queries); the K scale joins the softmax scale, the V scale the output. K = 3: each
    token's last 32-bit word holds a dummy head, poisoned (never read)."""
    rng = np.random.default_rng(8)
    kh = 3
    c = _case(rng, np.array([1, 6, 1]), np.array([17, 6, 9]), 3, 8, g=2, kh=kh, d=32, s=8, m=3)
    k_scale, v_scale = jnp.float32(0.05), jnp.float32(0.02)

    def quantize(x, scale):  # NaN stays in the unwritten slots' bytes for int8 as 0: poison 127
        x = np.asarray(x, np.float32) / float(scale)
        if kv_dtype == jnp.int8:
            return jnp.asarray(
                np.where(np.isnan(x), 127, np.clip(np.round(x), -127, 127)), kv_dtype
            )
        return jnp.asarray(x, kv_dtype)

    kv = merge_kv(quantize(c["k"], k_scale), quantize(c["v"], v_scale))  # [L, N, S, 2, 4, D]
    assert kv.shape[3:5] == (2, 4)
    poison = 127 if kv_dtype == jnp.int8 else np.nan
    kv = kv.at[:, :, :, -1, -2:].set(jnp.asarray(poison, kv_dtype))  # the dummy head
    args = (c["q"].astype(jnp.bfloat16), kv, c["kv_lens"], c["tables"], c["cu"],
            c["num_seqs"])  # fmt: skip
    kw = dict(num_kv_heads=kh, layer=LAYER, k_scale=k_scale, v_scale=v_scale)
    out = ragged_paged_attention_pages(*args, impl="pallas_triton", interpret=True, **kw)
    want = ragged_paged_attention_pages(*args, impl="reference", **kw)
    _check(out, want, jnp.bfloat16)


def test_forcing_pallas_triton_runs_it_and_records_the_name():
    rng = np.random.default_rng(3)
    c = _case(rng, np.array([3, 1]), np.array([9, 4]), 2, 4, g=4)
    cache = kp.PagedKVCache(c["kv"], jnp.ones(LAYERS), jnp.ones(LAYERS))
    with pytest.raises(ValueError, match="needs a CUDA target"):  # compiled, off a GPU
        kp.ragged_paged_attention(c["q"], cache, c["kv_lens"], c["tables"], c["cu"], 2,
                                  layer=LAYER, impl="pallas_triton")  # fmt: skip
    out = kp.ragged_paged_attention(c["q"], cache, c["kv_lens"], c["tables"], c["cu"], 2,
                                    layer=LAYER, impl="pallas_triton", interpret=True)  # fmt: skip
    _check(out, _ragged_oracle(c), jnp.float32)
    assert kp.kernel_info("cuda")["ragged_paged_attention"] == "pallas_triton"
    # KV ops have no Triton kernel: forced, they run XLA's scatter.
    new = jnp.zeros((1, 2, 16))
    kp.write_kv(cache, new, new, np.array([3], np.int32), layer=0, impl="pallas_triton")
    assert kp.kernel_info("cuda")["write_kv"] == "xla"


# --------------------------------------------------------------------------------------------
# What each capability gets, lowered for CUDA from this host
# --------------------------------------------------------------------------------------------


def _abstract(kind, *, g, d, s, dtype=jnp.bfloat16, kh=2):
    sds = jax.ShapeDtypeStruct
    cache = kp.kv_cache_shape(LAYERS, 16, s, kh, d, dtype)
    tables = sds((3, 4), jnp.int32)
    if kind == "decode":
        return (sds((3, kh * g, d), jnp.bfloat16), cache, sds((3,), jnp.int32), tables)
    return (sds((24, kh * g, d), jnp.bfloat16), cache, sds((3,), jnp.int32), tables,
            sds((4,), jnp.int32), sds((), jnp.int32))  # fmt: skip


def _export(kind, impl="auto", **geometry) -> str:
    op = kp.paged_attention if kind == "decode" else kp.ragged_paged_attention
    fn = jax.jit(functools.partial(op, impl=impl, layer=np.int32(LAYER)))
    exported = jax.export.export(
        fn, platforms=["cuda"], disabled_checks=compat.TRITON_EXPORT_CHECKS
    )
    return exported(*_abstract(kind, **geometry)).mlir_module()


@pytest.mark.parametrize("capability", ["8.0", "8.9", "10.0", "9.0"])
def test_cuda_export_per_capability_holds_its_kernel(capability):
    """8.0 / 8.9 / 10.0: the Triton call for both ops (and kernel_info says pallas_triton);
    9.0: the Triton call for the ragged op, decode still the Mosaic GPU kernel. Several
    targets in one process, nothing cached across them."""
    for kind in ("ragged", "decode"):
        mosaic = capability == "9.0" and kind == "decode"
        with aot.cuda_target(capability):
            text = _export(kind, g=4, d=128, s=16)
            info = kp.kernel_info("cuda")[f"{'' if kind == 'decode' else 'ragged_'}paged_attention"]
        assert (TRITON in text) != mosaic and (MOSAIC_GPU in text) == mosaic, (capability, kind)
        assert info == ("pallas_gpu" if mosaic else "pallas_triton"), info


def test_impl_pallas_on_a_non_hopper_target_is_the_triton_kernel():
    with aot.cuda_target("8.9"):
        assert TRITON in _export("ragged", impl="pallas", g=3, d=64, s=16)
        assert TRITON in _export("decode", impl="pallas_triton", g=8, d=64, s=16)
    assert kp.kernel_info("cuda@8.9")["paged_attention"] == "pallas_triton"


def test_float8_pages_before_ada_fall_back_to_xla_with_the_reason():
    with aot.cuda_target("8.0"):
        text = _export("ragged", g=4, d=64, s=16, dtype=jnp.float8_e4m3fn)
        info = kp.kernel_info("cuda")["ragged_paged_attention"]
    assert TRITON not in text and "float8_e4m3fn" in info and info.startswith("xla (fallback")
    with aot.cuda_target("8.9"):
        assert TRITON in _export("ragged", g=4, d=64, s=16, dtype=jnp.int8)


def test_unsupported_reason_names_each_limit_and_takes_every_g_up_to_8():
    def reason(**kw):
        base = dict(head_dim=128, num_q_per_kv=4, block_size=16, dtype=jnp.bfloat16,
                    capability="8.0")  # fmt: skip
        return ta.unsupported_reason(**{**base, **kw})

    assert "head_dim=96" in reason(head_dim=96)
    assert "(65)" in reason(num_q_per_kv=65)
    assert "7.5" in reason(capability="7.5")
    assert "8.9" in reason(dtype=jnp.float8_e4m3fn)
    assert "int32" in reason(dtype=jnp.int32)
    grid = itertools.product(
        ("8.0", "8.6", "8.9", "9.0", "10.0", "12.0"), range(1, 9), (64, 128, 256),
        (jnp.float32, jnp.bfloat16, jnp.float16, jnp.int8), (8, 16, 24, 128),
    )  # fmt: skip
    for cap, g, d, dtype, s in grid:
        assert reason(capability=cap, num_q_per_kv=g, head_dim=d, dtype=dtype, block_size=s) is None


WIDE = [
    pytest.param(cap, kind, g, d, id=f"{cap}-{kind}-g{g}-d{d}")
    for cap, kind, g, d in itertools.product(
        ("8.0", "8.9", "10.0"), ("decode", "ragged"), range(1, 9), (64, 128, 256)
    )
]


@pytest.mark.slow
@pytest.mark.parametrize("capability,kind,g,d", WIDE)
def test_every_capability_exports_the_triton_kernel_for_every_g_wide_grid(capability, kind, g, d):
    with aot.cuda_target(capability):
        assert TRITON in _export(kind, g=g, d=d, s=16)
