"""Incremental detokenization: a growing list of ids as text deltas, never a broken character.

:class:`IncrementalDecoder` has two paths, chosen once from the tokenizer:

* **bytes**, for a tokenizer whose text is its tokens' byte strings concatenated and decoded as
  UTF-8 with replacement (the bundled ``ByteTokenizer``; HF tokenizers with a ``ByteLevel``
  decoder: GPT-2, Llama 3, Qwen2/3, gpt-oss, ...). Such a tokenizer offers
  ``byte_decoder(skip_special_tokens)``, a function from ids to those bytes. Each push is one
  call of it and one call of Python's incremental UTF-8 decoder (``errors="replace"``), which
  holds back only the bytes of a character still incomplete (at most 3) and nothing else: no
  id is decoded twice, and the text at every point is the longest prefix of
  ``tokenizer.decode(ids)`` the ids so far determine (a flush gives the rest).
* **window**, for every other tokenizer (SentencePiece-style decoders, whose text for an id
  depends on its neighbours): vLLM's incremental detokenizer, which decodes a short window
  of ids per push and holds back text ending in U+FFFD (``MAX_HELD_TOKENS`` at most).

A multi-step decode hands a row's tokens over at once (:meth:`IncrementalDecoder.push_chunk`):
the bytes path takes them in one call; the window path in three decodes where the text allows.
"""

from __future__ import annotations

import codecs
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from paxcache.models.tokenizer import Tokenizer

__all__ = ["MAX_HELD_TOKENS", "IncrementalDecoder"]

MAX_HELD_TOKENS = 8
"""``IncrementalDecoder``'s window path holds back at most this many tokens waiting for a UTF-8
character to complete; past that it emits U+FFFD (a model emitting invalid UTF-8 forever stays
linear)."""


class IncrementalDecoder:
    """Streams text from a growing id list without emitting broken UTF-8, in linear time.

    Example:
        >>> dec = IncrementalDecoder(tok)
        >>> for tok_id in stream: print(dec.push(tok_id), end="")
        >>> print(dec.flush())

    The text of all pushes and the final flush is ``tokenizer.decode(ids)``; every push
    returns only text no later id can change. With a tokenizer's ``byte_decoder`` (see the
    module docstring) a push decodes only its own ids' bytes. Otherwise it decodes a short
    window of ids, never the whole list (as vLLM's incremental detokenizer):
    ``ids[prefix:read]`` were emitted already, ``ids[read:]`` are new. Each push decodes
    ``ids[prefix:read]`` and ``ids[prefix:]`` and emits the difference; the window then slides
    to ``prefix = read, read = len(ids)``. Decoding from ``prefix`` (not from ``read``) keeps
    context-dependent pieces right (e.g. SentencePiece's leading space). A window whose text
    ends in U+FFFD (an incomplete multi-byte character) is held back, at most
    ``MAX_HELD_TOKENS`` tokens, until more ids arrive or ``flush``.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # window path: start of the decode window
        self._read = 0  # window path: ids before this were emitted
        make = getattr(tokenizer, "byte_decoder", None)
        self._to_bytes: Callable[[Sequence[int]], bytes] | None = (
            make(skip_special_tokens) if callable(make) else None
        )
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace") if self._to_bytes else None

    @property
    def byte_level(self) -> bool:
        """Whether pushes take the bytes path (see the module docstring)."""
        return self._to_bytes is not None

    def push(self, *ids: int) -> str:
        """Adds ids; returns the newly completed text (maybe empty)."""
        if self._utf8 is not None:
            return self._push_bytes([int(i) for i in ids])
        if len(ids) == 1:
            self.ids.append(int(ids[0]))
        else:
            self.ids.extend(int(i) for i in ids)
        return self._advance(final=False)

    def push_chunk(self, ids: Sequence[int]) -> str:
        """Adds ``ids``; returns what pushing them one by one would have returned in total
        (every later call then returns what it would after those pushes).

        The bytes path decodes the chunk's bytes in one call. The window path uses three
        decodes when that total can be told at once: nothing is held back now, ``ids`` are
        at most ``MAX_HELD_TOKENS`` (no push of theirs could be forced out early), the
        window's text has no U+FFFD (no incomplete character was held or forced out along
        the way) and the last id adds text (so one by one nothing would be held at the end
        either). Otherwise it pushes them one by one (two decodes each), here, so the caller
        never does.
        """
        if self._utf8 is not None:  # the bytes path: a list (of ints) is taken as it is
            return self._push_bytes(ids if type(ids) is list else list(map(int, ids)))
        ids = list(map(int, ids))
        if not ids:
            return ""
        at_once = self._chunk_at_once(ids)
        if at_once is not None:
            return at_once
        pieces = []
        for i in ids:
            self.ids.append(i)
            pieces.append(self._advance(final=False))
        return "".join(pieces)

    def flush(self) -> str:
        """Returns any held-back text (incomplete characters as U+FFFD)."""
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        return self._advance(final=True)

    def _push_bytes(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        return self._utf8.decode(self._to_bytes(ids))

    def _chunk_at_once(self, ids: list[int]) -> str | None:
        """:meth:`push_chunk`'s three-decode path; None, adding nothing, when it cannot tell."""
        if self._read != len(self.ids) or len(ids) > MAX_HELD_TOKENS:
            return None
        window = self.ids[self._prefix :]
        text = self._decode(window + ids)
        if "\ufffd" in text:  # the common refusal first: one decode spent
            return None
        seen = self._decode(window)
        if not text.startswith(seen):  # a decoder that rewrites earlier text: id by id
            return None
        if len(text) <= len(self._decode(window + ids[:-1])):
            return None
        self.ids.extend(ids)
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(seen) :]

    def _advance(self, *, final: bool) -> str:
        if self._read >= len(self.ids):
            return ""
        seen = self._decode(self.ids[self._prefix : self._read])
        text = self._decode(self.ids[self._prefix :])
        held = len(self.ids) - self._read
        incomplete = text.endswith("\ufffd") or len(text) <= len(seen)
        if incomplete and not final and held < MAX_HELD_TOKENS:
            return ""
        # If the decoder ever rewrote the window's earlier text (byte-level and BPE decoders
        # do not), the rewrite is not re-emitted: streamed text cannot be undone.
        delta = text[len(seen) :]
        self._prefix, self._read = self._read, len(self.ids)
        return delta

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""
