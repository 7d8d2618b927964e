"""KV movement entry points (placeholder: reference path only until the kernels land)."""

from kernels_pallas import reference


def write_kv(k_pages, v_pages, k, v, slot_mapping, **kw):  # noqa: D103
    return reference.write_kv_reference(k_pages, v_pages, k, v, slot_mapping)


def copy_blocks(k_pages, v_pages, src, dst, **kw):  # noqa: D103
    return reference.copy_blocks_reference(k_pages, v_pages, src, dst)


def swap_blocks(src_pages, dst_pages, src_ids, dst_ids, **kw):  # noqa: D103
    return reference.swap_blocks_reference(src_pages, dst_pages, src_ids, dst_ids)
