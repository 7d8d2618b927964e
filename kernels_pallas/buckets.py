"""Power-of-two buckets: the one rule for padding a size so a program compiles once per bucket.

Every padded dimension in the repository goes through these two functions: swap pair counts
(:func:`kernels_pallas.kv_ops.bucket_size`), the engine's step token counts, the host-side
block manager's row widths, the dense greedy decoder's sequence length. Here, in the package
that imports nothing of ``paxcache``, so both packages can use it.
"""

from __future__ import annotations

__all__ = ["next_power_of_two", "power_of_two_buckets"]


def next_power_of_two(n: int, minimum: int = 1) -> int:
    """The smallest power of two that is ``>= n`` and ``>= minimum``.

    Args:
      n: the size to pad (any int; ``n <= 1`` gives ``minimum`` rounded up).
      minimum: the smallest bucket (>= 1; rounded up to a power of two).

    Raises:
      ValueError: ``minimum < 1``.
    """
    if minimum < 1:
        raise ValueError(f"next_power_of_two: minimum must be >= 1, got {minimum}")
    n = max(int(n), int(minimum))
    return 1 << (n - 1).bit_length()


def power_of_two_buckets(largest: int, smallest: int = 1) -> tuple[int, ...]:
    """The bucket sizes up to ``largest``: ``smallest, 2 * smallest, ...`` while below
    ``largest``, then ``largest`` itself (which need not be a power of two).

    ``next(b for b in buckets if b >= n)`` is then the padded size of any ``n <= largest``.

    Args:
      largest: the biggest size (>= 1), always the last bucket.
      smallest: the first bucket when it is below ``largest`` (>= 1).

    Raises:
      ValueError: ``largest < 1`` or ``smallest < 1``.
    """
    if largest < 1 or smallest < 1:
        raise ValueError(
            f"power_of_two_buckets: largest and smallest must be >= 1, got {largest}, {smallest}"
        )
    buckets = []
    b = min(int(smallest), int(largest))
    while b < largest:
        buckets.append(b)
        b *= 2
    buckets.append(int(largest))
    return tuple(buckets)
