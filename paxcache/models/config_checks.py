"""Range and type checks of the ``config.json`` fields the checkpoint loader sizes things from.

:func:`check_config_values` runs before anything is allocated from a config, so a hostile or
broken config.json is a clear :class:`~paxcache.errors.CheckpointError`, never a huge allocation.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from paxcache.errors import CheckpointError

__all__ = ["CONFIG_LIMITS", "check_config_values"]

CONFIG_LIMITS: dict[str, tuple[int, int]] = {
    "vocab_size": (1, 1 << 22),
    "hidden_size": (1, 1 << 16),
    "intermediate_size": (1, 1 << 19),
    "num_hidden_layers": (1, 1024),
    "num_attention_heads": (1, 1024),
    "num_key_value_heads": (1, 1024),
    "head_dim": (2, 4096),
    "max_position_embeddings": (1, 1 << 24),
    "sliding_window": (1, 1 << 24),
    "max_window_layers": (0, 1024),
    "original_max_position_embeddings": (1, 1 << 24),
    "sliding_window_pattern": (1, 1024),
}
"""Inclusive ``(min, max)`` of the integer ``config.json`` fields, checked before anything is
sized from them. The largest released models are well inside (vocabularies ~256K, hidden size
~16K, ~130 layers, 128 heads, contexts ~10M tokens)."""

_FLOAT_LIMITS: dict[str, tuple[float, float]] = {
    "rms_norm_eps": (0.0, 1.0),  # exclusive min
    "rope_theta": (0.0, 1e12),
    "partial_rotary_factor": (0.0, 1.0),
    "rope_local_base_freq": (0.0, 1e12),
    "query_pre_attn_scalar": (0.0, 1e8),
    "attn_logit_softcapping": (0.0, 1e6),
    "final_logit_softcapping": (0.0, 1e6),
}
_REQUIRED_FIELDS = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
)
_BOOL_FIELDS = (
    "tie_word_embeddings",
    "attention_bias",
    "use_sliding_window",
    "mlp_bias",
    "use_bidirectional_attention",
)


def check_config_values(d: Mapping[str, Any], where: str = "config.json") -> None:
    """Checks the type and range of every ``config.json`` field the loader uses.

    Args:
      d: the parsed config.
      where: the file name, for messages.

    Raises:
      CheckpointError: naming the first bad field, its value and the allowed range.
    """

    def bad(field: str, value: Any, want: str) -> CheckpointError:
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        return CheckpointError(f"{where}: field {field} must be {want}, got {shown}")

    def is_int(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool)

    for field, (lo, hi) in CONFIG_LIMITS.items():
        v = d.get(field)
        optional = field in (
            "num_key_value_heads",
            "head_dim",
            "sliding_window",
            "original_max_position_embeddings",
            "sliding_window_pattern",
        )
        if v is None and (optional or field not in _REQUIRED_FIELDS):
            continue
        if not is_int(v) or not lo <= v <= hi:
            raise bad(field, v, f"an int in [{lo}, {hi}]")
    for field, (lo, hi) in _FLOAT_LIMITS.items():
        v = d.get(field)
        if v is None:
            continue
        if (
            not isinstance(v, (int, float))
            or isinstance(v, bool)
            or not math.isfinite(v)
            or not lo < v <= hi
        ):
            raise bad(field, v, f"a finite number in ({lo:g}, {hi:g}]")
    for field in _BOOL_FIELDS:
        v = d.get(field)
        if v is not None and not isinstance(v, bool):
            raise bad(field, v, "true or false")
    for field in ("hidden_act", "hidden_activation", "torch_dtype"):
        v = d.get(field)
        if v is not None and not isinstance(v, str):
            raise bad(field, v, "a string")
    vocab = d.get("vocab_size")
    for field in ("bos_token_id", "pad_token_id", "eos_token_id"):
        v = d.get(field)
        ids = v if field == "eos_token_id" and isinstance(v, list) else [v]
        if v is None or (isinstance(v, list) and not v):
            continue
        if len(ids) > 1024 or not all(is_int(t) and 0 <= t < vocab for t in ids):
            kind = "a token id or a list of token ids" if field == "eos_token_id" else "a token id"
            raise bad(field, v, f"{kind} in [0, vocab_size={vocab})")
    rs = d.get("rope_scaling")
    if rs is not None:
        if not isinstance(rs, dict):
            raise bad("rope_scaling", rs, "an object or null")
        for k, v in rs.items():
            if k in ("rope_type", "type"):
                if not isinstance(v, str):
                    raise bad(f"rope_scaling.{k}", v, "a string")
            elif (
                isinstance(v, (int, float))
                and not isinstance(v, bool)
                and (not math.isfinite(v) or not 0 < v <= 1e12)
            ):
                raise bad(f"rope_scaling.{k}", v, "a finite number in (0, 1e12]")
    layer_types = d.get("layer_types")
    if layer_types is not None and (
        not isinstance(layer_types, list)
        or len(layer_types) != d.get("num_hidden_layers")
        or not all(isinstance(t, str) for t in layer_types)
    ):
        raise bad("layer_types", layer_types, "a list of num_hidden_layers strings")
