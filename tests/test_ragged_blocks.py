"""The TPU ragged kernel's block sizes per chip (no libtpu needed: the rule only)."""

from __future__ import annotations

import hypothesis


@hypothesis.settings(max_examples=30, deadline=None)
@hypothesis.given(
    kv_heads=hypothesis.strategies.integers(1, 32),
    head_dim=hypothesis.strategies.sampled_from([64, 128, 256]),
    itemsize=hypothesis.strategies.sampled_from([2, 4]),
)
def test_block_rows_keep_every_query_block_within_the_row_budget(kv_heads, head_dim, itemsize):
    """The ragged kernel's query rows per block: the table's, fewer when a model's kv heads or
    head dim would take more VMEM than Llama-3-8B's 1024 rows; a multiple of 8, at least 8."""
    from kernels_pallas.tpu import ragged_paged_attention as rag

    blocks = rag.RAGGED_BLOCKS["TPU v5 lite"]
    rows = rag.block_rows(blocks, kv_heads, head_dim, itemsize)
    per_row = kv_heads * (4 * head_dim * itemsize + 4 * head_dim + 1024)
    assert rows % 8 == 0 and 8 <= rows <= blocks.rows
    assert rows * per_row <= rag.ROW_VMEM_BUDGET or rows == 8
    assert rows == blocks.rows or (rows + 8) * per_row > rag.ROW_VMEM_BUDGET
    assert rag.block_rows(blocks, 8, 128, 2) == 1024  # Llama-3-8B: the table's own
