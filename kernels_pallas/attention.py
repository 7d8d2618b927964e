"""Paged attention entry points (placeholder: reference path only until the kernels land)."""

from kernels_pallas import reference


def paged_attention(q, k_pages, v_pages, lengths, block_tables, **kw):  # noqa: D103
    kw.pop("impl", None), kw.pop("interpret", None)
    return reference.paged_attention_reference(q, k_pages, v_pages, lengths, block_tables, **kw)


def ragged_paged_attention(q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, **kw):  # noqa: D103
    kw.pop("impl", None), kw.pop("interpret", None)
    return reference.ragged_paged_attention_xla(
        q, k_pages, v_pages, kv_lens, block_tables, cu_q_lens, num_seqs, **kw
    )
