"""The TPU kernels' block sizes per chip: the ragged kernel's query rows, the decode kernel's
pages per step (no libtpu needed: the rules only)."""

from __future__ import annotations

import hypothesis


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    kv_heads=hypothesis.strategies.integers(1, 32),
    head_dim=hypothesis.strategies.sampled_from([64, 128, 256]),
    itemsize=hypothesis.strategies.sampled_from([2, 4]),
    device_kind=hypothesis.strategies.sampled_from(["TPU v5 lite", "TPU v6 lite", "TPU7x", None]),
)
def test_block_rows_keep_every_query_block_within_the_row_budget(
    kv_heads, head_dim, itemsize, device_kind
):
    """The ragged kernel's query rows per block: the table's, fewer when a model's kv heads or
    head dim would take more VMEM than the chip's row budget (40 MiB on v5e and v6e, 20 MiB,
    Llama-3-8B's 1024 rows, elsewhere); a multiple of 8, at least 8."""
    from kernels_pallas.tpu import ragged_paged_attention as rag

    blocks = rag.ragged_blocks(device_kind)
    rows = rag.block_rows(blocks, kv_heads, head_dim, itemsize)
    per_row = kv_heads * (4 * head_dim * itemsize + 4 * head_dim + 1024)
    budget = (40 if device_kind in ("TPU v5 lite", "TPU v6 lite") else 20) << 20
    assert blocks.row_budget == budget
    assert rows % 8 == 0 and 8 <= rows <= blocks.rows
    assert rows * per_row <= budget or rows == 8
    assert rows == blocks.rows or (rows + 8) * per_row > budget
    tpu_blocks = rag.ragged_blocks("TPU v5 lite")
    assert rag.block_rows(tpu_blocks, 8, 128, 2) == 1024  # Llama-3-8B: the table's own
    assert rag.block_rows(tpu_blocks, 8, 256, 2) == 1024  # head_dim 256: 640 in 20 MiB
    assert rag.block_rows(rag.ragged_blocks("TPU7x"), 8, 256, 2) == 640


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    kv_heads=hypothesis.strategies.integers(1, 32),
    head_dim=hypothesis.strategies.sampled_from([64, 128, 256]),
    itemsize=hypothesis.strategies.sampled_from([1, 2, 4]),
    page=hypothesis.strategies.sampled_from([8, 16, 32, 64, 128]),
    device_kind=hypothesis.strategies.sampled_from(
        ["TPU v5 lite", "TPU v6 lite", "TPU7x", "TPU v4", None]
    ),
)
def test_decode_steps_take_up_to_2048_keys_within_the_chips_budget(
    kv_heads, head_dim, itemsize, page, device_kind
):
    """The decode kernel's pages per step: ~2048 keys, as many as two slots of them fit the
    chip's KV budget (32 MiB where VMEM is 64 MiB or more, else 16 MiB), at least one page."""
    from kernels_pallas.tpu import _attention_common as common
    from kernels_pallas.tpu import paged_attention as dec

    max_blocks = 32768 // page
    pages = dec.decode_pages_per_step(
        page, max_blocks, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize,
        device_kind=device_kind,
    )  # fmt: skip
    budget = dec.decode_kv_vmem_budget(device_kind)
    assert budget == (32 if device_kind in ("TPU v5 lite", "TPU v6 lite", "TPU7x") else 16) << 20
    per_page = 2 * common.kv_page_bytes(page, common.combined_rows_of(kv_heads, itemsize), head_dim)
    assert 1 <= pages <= max(1, 2048 // page)
    assert pages == 1 or pages * per_page <= budget
    assert pages == max(1, 2048 // page) or (pages + 1) * per_page > budget


def test_wide_kv_pages_take_twice_the_keys_per_decode_step_on_chips_with_64_mib_of_vmem():
    """32 kv heads of head dim 128 (16 KiB of K and V per token): 1024 keys per step on v5e,
    v6e and TPU7x, 512 elsewhere; Llama-3-8B's 8 kv heads take 2048 keys on every chip."""
    from kernels_pallas.tpu import paged_attention as dec

    def keys(kv_heads, kind):
        size = dict(kv_heads=kv_heads, head_dim=128, itemsize=2, device_kind=kind)
        return 16 * dec.decode_pages_per_step(16, 2048, **size)

    assert [keys(32, k) for k in ("TPU v5 lite", "TPU v6 lite", "TPU7x", "TPU v4", None)] == [
        1024, 1024, 1024, 512, 512
    ]  # fmt: skip
    assert {keys(8, k) for k in ("TPU v5 lite", "TPU v4", None)} == {2048}


def test_ragged_steps_take_1024_keys_where_the_chip_gives_their_kv_16_mib():
    """The ragged kernel's pages per step: about ``keys`` of the chip's table, as many as
    two slots fit its KV budget: on v5e and v6e (128 MiB of VMEM) 1024 keys for Llama-3-8B
    and for head_dim 256 with 8 kv heads (16 MiB: RPA v3's 1024-key blocks); 512 on TPU7x
    and any other chip (8 MiB); 8-bit pages take the same keys in half the bytes. On v5e and
    v6e the step's f32 logits of every kv head stay within 32 MiB: 16 or 32 kv heads take
    512 keys (at 1024 keys 16 kv heads need 106 MiB of scoped VMEM)."""
    from kernels_pallas.tpu import _attention_common as common
    from kernels_pallas.tpu import ragged_paged_attention as rag

    def keys(kind, kv_heads, head_dim, itemsize=2, page=16):
        blocks = rag.ragged_blocks(kind)
        rows = rag.block_rows(blocks, kv_heads, head_dim, 2)
        target = rag.step_keys(blocks, kv_heads, rows)
        assert blocks.logits_budget is None or 4 * rows * kv_heads * target <= (32 << 20)
        pages = common.default_pages_per_compute_block(
            page, 2048, target, kv_heads=kv_heads, head_dim=head_dim, itemsize=itemsize,
            kv_budget=blocks.kv_budget,
        )  # fmt: skip
        # The op's one rule (step_pages) is this composition.
        op_pages = rag.step_pages(
            blocks, page, 2048, kv_heads=kv_heads, head_dim=head_dim, q_itemsize=2,
            kv_itemsize=itemsize,
        )  # fmt: skip
        assert pages == op_pages
        per_page = 2 * common.kv_page_bytes(
            page, common.combined_rows_of(kv_heads, itemsize), head_dim
        )
        assert pages * per_page <= blocks.kv_budget
        return pages * page

    kinds = ("TPU v5 lite", "TPU v6 lite", "TPU7x", "TPU v4", None)
    assert [keys(k, 8, 128) for k in kinds] == [1024, 1024, 512, 512, 512]
    assert [keys(k, 8, 256) for k in kinds] == [1024, 1024, 512, 512, 512]
    assert [keys(k, 8, 256, itemsize=1) for k in kinds] == [1024, 1024, 512, 512, 512]
    assert [keys(k, 16, 128) for k in kinds] == [512] * 5  # the logits' 32 MiB on v5e, v6e
    assert keys("TPU v5 lite", 32, 128) == 512  # 32 kv heads: 16 MiB holds 512
    assert keys("TPU v6 lite", 4, 128) == 1024  # Qwen2-7B: 1008 rows
    assert rag.ragged_blocks("TPU v5 lite").kv_budget == 16 << 20
    assert rag.ragged_blocks("TPU7x").kv_budget == common.KV_VMEM_BUDGET == 8 << 20


@hypothesis.settings(max_examples=40, deadline=None)
@hypothesis.given(
    kv_heads=hypothesis.strategies.integers(1, 64),
    rows=hypothesis.strategies.integers(1, 128).map(lambda r: 8 * r),
    device_kind=hypothesis.strategies.sampled_from(["TPU v5 lite", "TPU v6 lite", "TPU7x", None]),
)
def test_step_keys_keep_the_logits_within_budget_in_whole_lane_tiles(kv_heads, rows, device_kind):
    """The ragged kernel's keys per step: the table's, or the most whole 128-key tiles whose
    float32 logits of every kv head fit the chip's logits budget (at least one tile)."""
    from kernels_pallas.tpu import ragged_paged_attention as rag

    blocks = rag.ragged_blocks(device_kind)
    keys = rag.step_keys(blocks, kv_heads, rows)
    if blocks.logits_budget is None:
        assert keys == blocks.keys
        return
    assert keys % 128 == 0 and 128 <= keys <= blocks.keys
    assert keys == 128 or 4 * rows * kv_heads * keys <= blocks.logits_budget
    assert keys == blocks.keys or 4 * rows * kv_heads * (keys + 128) > blocks.logits_budget


def test_kv_cache_vmem_bytes_is_the_larger_kernels_kv_double_buffer_on_the_chip():
    """``kp.kv_cache_vmem_bytes``: two slots of the pages per step of whichever TPU kernel
    takes more on the chip (the decode kernel's ~2048 keys within its budget, the ragged
    kernel's ``step_pages``), never more than the sequence's own pages; head_dim 64 is
    stored in 128 lanes."""
    import jax.numpy as jnp

    import kernels_pallas as kp

    bf16 = jnp.bfloat16
    llama = dict(block_size=16, num_kv_heads=8, head_dim=128, dtype=bf16)  # 4 KiB per token

    def vmem(max_blocks, kind=None, **model):
        return kp.kv_cache_vmem_bytes(**model, max_blocks_per_seq=max_blocks, device_kind=kind)

    for kind in ("TPU v5 lite", "TPU v6 lite", "TPU7x", "TPU v4", None):
        assert vmem(2048, kind, **llama) == 2 * 2048 * 4096  # decode: 2048 keys
        assert vmem(4, kind, **llama) == 2 * 64 * 4096  # a 64-token sequence: its 4 pages
    assert vmem(4, **dict(llama, head_dim=64)) == 2 * 64 * 4096  # lane-padded to 128
    wide = dict(llama, num_kv_heads=32)  # MHA: 16 KiB per token
    assert vmem(2048, "TPU v6 lite", **wide) == 2 * 1024 * 16384  # decode's 32 MiB: 1024 keys
    assert vmem(2048, "TPU v4", **wide) == 2 * 512 * 16384  # 16 MiB: 512 keys
    gemma = dict(llama, head_dim=256)  # 8 KiB per token: decode 2048 keys in 32 MiB
    assert vmem(2048, "TPU v5 lite", **gemma) == 2 * 2048 * 8192
    assert vmem(2048, "TPU v5 lite", **dict(gemma, dtype=jnp.int8)) == 2 * 2048 * 4096


@hypothesis.settings(max_examples=200, deadline=None)
@hypothesis.given(
    g=hypothesis.strategies.integers(1, 16),
    rows=hypothesis.strategies.integers(8, 4096),
    num_tokens=hypothesis.strategies.integers(1, 5000),
)
def test_query_blocks_are_the_largest_power_of_two_within_the_rows(g, rows, num_tokens):
    """TQ is a power of two of at most ``rows / G`` tokens (the largest; at least the 8-row
    tile's), so a chunk of a power of two of tokens splits into whole blocks; a batch that
    fits takes one block."""
    from kernels_pallas.tpu.ragged_paged_attention import default_queries_per_block

    tq = default_queries_per_block(num_tokens, g, rows)
    full = default_queries_per_block(10**6, g, rows)
    assert full & (full - 1) == 0 and (full * g) % 8 == 0
    assert full * g <= rows or (full // 2 * g) % 8 != 0  # within the rows, or the tile's
    assert 2 * full * g > rows  # the largest
    assert tq == (num_tokens if num_tokens <= full else full)


def test_tpu7x_blocks_hold_qwen2s_256_tokens_and_llamas_1024_rows():
    """TPU7x's 2048 target rows (RPA v3's TPU7x blocks): G = 7 with 4 kv heads of head_dim
    128 takes 256-token blocks (1792 rows, within the 20 MiB row budget); Llama-3-8B's 8 kv
    heads stay at 1024 rows (256 tokens); v5e keeps 128 tokens for G = 7."""
    from kernels_pallas.tpu import ragged_paged_attention as rag

    def tokens(kind: str, kv_heads: int, g: int) -> int:
        rows = rag.block_rows(rag.ragged_blocks(kind), kv_heads, 128, 2)
        return rag.default_queries_per_block(10**6, g, rows)

    assert tokens("TPU7x", 4, 7) == 256
    assert rag.block_rows(rag.ragged_blocks("TPU7x"), 8, 128, 2) == 1024
    assert tokens("TPU7x", 8, 4) == 256
    assert tokens("TPU v5 lite", 4, 7) == 128
