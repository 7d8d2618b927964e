"""Tokenizers: HF ``tokenizer.json`` via the ``tokenizers`` library, or a byte-level fallback.

Both implement the ``Tokenizer`` protocol: ``encode`` (``add_special_tokens=True`` adds BOS
the way HF ``tokenizer(text)`` does), ``decode``, ``bos_token_id``,
``eos_token_id``, ``vocab_size`` and ``apply_chat_template``. ``IncrementalDecoder`` turns a
growing list of ids into text deltas without ever emitting a broken UTF-8 character.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

logger = logging.getLogger(__name__)

Message = Mapping[str, str]

SIMPLE_CHAT_TEMPLATE_DOC = """Fallback chat template (no jinja2 or no template in the checkpoint):

    <|role|>\\n{content}\\n   for each message, then   <|assistant|>\\n   when
    add_generation_prompt is true.
"""


def simple_chat_template(messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
    """Renders messages as ``<|role|>\\ncontent\\n`` blocks plus ``<|assistant|>\\n``."""
    parts = [f"<|{m['role']}|>\n{m['content']}\n" for m in messages]
    if add_generation_prompt:
        parts.append("<|assistant|>\n")
    return "".join(parts)


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and server need from a tokenizer."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def bos_token_id(self) -> int | None: ...

    @property
    def eos_token_id(self) -> int | None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as ids 0..255, then BOS, EOS, PAD (ids 256, 257, 258 by default).

    Used by the bundled tiny model. ``decode`` drops special ids and replaces invalid UTF-8.
    """

    def __init__(
        self, bos_token_id: int = 256, eos_token_id: int = 257, pad_token_id: int = 258
    ) -> None:
        self._bos, self._eos, self._pad = bos_token_id, eos_token_id, pad_token_id
        self._vocab = max(256, bos_token_id + 1, eos_token_id + 1, pad_token_id + 1)

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def bos_token_id(self) -> int:
        return self._bos

    @property
    def eos_token_id(self) -> int:
        return self._eos

    @property
    def pad_token_id(self) -> int:
        return self._pad

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> UTF-8 byte ids, with BOS first when ``add_special_tokens``."""
        ids = list(text.encode("utf-8"))
        return [self._bos, *ids] if add_special_tokens else ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Ids -> raw bytes, dropping ids >= 256 (specials)."""
        return bytes(int(i) for i in ids if 0 <= int(i) < 256)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text; invalid UTF-8 becomes U+FFFD. Specials are always dropped."""
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str:
        """See ``SIMPLE_CHAT_TEMPLATE_DOC``."""
        return simple_chat_template(messages, add_generation_prompt)


def _token_content(tok: Any) -> str | None:
    if tok is None:
        return None
    if isinstance(tok, str):
        return tok
    if isinstance(tok, Mapping):
        return tok.get("content")
    return None


class HFTokenizer:
    """A ``tokenizers.Tokenizer`` from ``tokenizer.json`` plus ``tokenizer_config.json`` info.

    Args:
        path: directory containing tokenizer.json (and optionally tokenizer_config.json).
        bos_token_id, eos_token_id: fallbacks from config.json when tokenizer_config.json
            does not name the special tokens.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        bos_token_id: int | None = None,
        eos_token_id: int | None = None,
    ) -> None:
        from tokenizers import Tokenizer as _HFTok

        path = Path(path)
        self._tok = _HFTok.from_file(str(path / "tokenizer.json"))
        cfg_path = path / "tokenizer_config.json"
        self.config: dict[str, Any] = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        self.chat_template: str | None = self.config.get("chat_template")
        if isinstance(self.chat_template, list):  # [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()), None)
        self.bos_token = _token_content(self.config.get("bos_token"))
        self.eos_token = _token_content(self.config.get("eos_token"))
        self._bos = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self._eos = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        if self._bos is None:
            self._bos = bos_token_id
            if bos_token_id is not None:
                self.bos_token = self._tok.id_to_token(bos_token_id)
        if self._eos is None:
            self._eos = eos_token_id
            if eos_token_id is not None:
                self.eos_token = self._tok.id_to_token(eos_token_id)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token_id(self) -> int | None:
        return self._bos

    @property
    def eos_token_id(self) -> int | None:
        return self._eos

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Text -> ids. With ``add_special_tokens`` the tokenizer.json post-processor runs
        (e.g. Llama's adds BOS, Qwen2's adds nothing), as in HF ``tokenizer(text)``. Encode
        a rendered chat template with ``add_special_tokens=False``: templates include BOS."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str:
        """Renders the checkpoint's jinja ``chat_template`` if jinja2 is installed.

        Falls back to ``simple_chat_template`` (see ``SIMPLE_CHAT_TEMPLATE_DOC``) when there is
        no template or jinja2 is not installed.
        """
        if self.chat_template:
            try:
                import jinja2
            except ImportError:
                logger.warning("jinja2 not installed; using the simple chat template")
            else:
                env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)

                def raise_exception(msg: str) -> None:
                    raise ValueError(f"chat template error: {msg}")

                env.globals["raise_exception"] = raise_exception
                return env.from_string(self.chat_template).render(
                    messages=list(messages),
                    add_generation_prompt=add_generation_prompt,
                    bos_token=self.bos_token or "",
                    eos_token=self.eos_token or "",
                )
        return simple_chat_template(messages, add_generation_prompt)


class IncrementalDecoder:
    """Streams text from a growing id list without emitting broken UTF-8.

    Example:
        >>> dec = IncrementalDecoder(tok)
        >>> for tok_id in stream: print(dec.push(tok_id), end="")
        >>> print(dec.flush())

    Decodes the whole id list and emits only the new suffix, holding back a trailing
    U+FFFD (an incomplete multi-byte character) until more ids arrive or ``flush``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._emitted = ""

    def push(self, *ids: int) -> str:
        """Adds ids; returns the newly completed text (maybe empty)."""
        self.ids.extend(int(i) for i in ids)
        text = self._tok.decode(self.ids, skip_special_tokens=self._skip)
        if text.endswith("\ufffd"):
            return ""
        return self._take(text)

    def flush(self) -> str:
        """Returns any held-back text (incomplete characters as U+FFFD)."""
        return self._take(self._tok.decode(self.ids, skip_special_tokens=self._skip))

    def _take(self, text: str) -> str:
        # Emit only what lies past the already-emitted length. Byte-level and BPE decoders
        # are prefix-stable once the held-back U+FFFD rule is applied; if a decoder ever
        # rewrites earlier text, the rewrite is not re-emitted (streamed text can't be undone).
        delta = text[len(self._emitted) :]
        self._emitted = text
        return delta


def load_tokenizer(path: str | os.PathLike[str], config: Any | None = None) -> Tokenizer:
    """The tokenizer for a checkpoint directory.

    ``tokenizer.json`` -> ``HFTokenizer``; otherwise a ``ByteTokenizer`` whose special ids come
    from config.json (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) when set.
    """
    path = Path(path)
    bos = getattr(config, "bos_token_id", None)
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, tuple):
        eos = eos[0] if eos else None
    if (path / "tokenizer.json").is_file():
        return HFTokenizer(path, bos_token_id=bos, eos_token_id=eos)
    pad = getattr(config, "pad_token_id", None)
    kwargs = {}
    if bos is not None:
        kwargs["bos_token_id"] = bos
    if eos is not None:
        kwargs["eos_token_id"] = eos
    if pad is not None:
        kwargs["pad_token_id"] = pad
    return ByteTokenizer(**kwargs)
