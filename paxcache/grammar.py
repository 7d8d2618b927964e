"""Constrained decoding: the glue between :class:`~paxcache.sampling.StructuredOutputsParams`
and the llguidance grammar library.

llguidance (Rust, CPU-only, no torch) compiles JSON schemas, regular expressions and Lark
grammars lazily against a tokenizer and computes each step's allowed-token bitmask in tens of
microseconds (``scripts/bench_structured.py``); paxcache never parses grammars itself. It is an
optional dependency (the ``structured`` extra): the engine imports and runs without it, and a
constrained request then fails with :class:`GrammarUnavailableError`.

Why llguidance, of the three libraries vLLM and SGLang use: xgrammar's wheel depends on torch
(``pip install xgrammar`` resolves torch, triton and transformers, several GB with a CUDA
build), which a JAX runtime must not pull in; outlines-core turns a JSON schema into a regular
expression and builds the token index of the whole automaton up front (no recursive schemas,
no context-free grammars, and a compile cost that grows with vocabulary and schema size).
llguidance has no Python dependencies, parses context-free grammars (JSON schema, Lark, regex)
lazily, needs no per-grammar precompute over the vocabulary, and takes any tokenizer given its
token bytes (the byte-level tiny model included).

The pieces, host side only:

* :func:`grammar_source` / :func:`validate`: a constraint -> llguidance grammar text, with a
  clear :class:`GrammarError` when the library rejects it (the server calls it before
  submitting, so a bad schema is a 400).
* :class:`GrammarCompiler`: one per engine; wraps the engine's tokenizer (an HF
  ``tokenizer.json`` tokenizer or the byte-level :class:`~paxcache.models.tokenizer.ByteTokenizer`)
  as an ``LLTokenizer`` once, caches compiled grammars, and makes a :class:`Matcher` per
  sequence.
* :class:`Matcher`: one sequence's position in its grammar. It consumes exactly the tokens
  the sequence generates (``Scheduler.postprocess``), so preemption (recompute or swap) needs
  nothing: the generated tokens are kept, and so is the matcher.
* :func:`fill_bitmask`: writes the rows' allowed-token masks, ``i32[R, ceil(V/32)]`` (bit ``t
  % 32`` of word ``t // 32`` set = token ``t`` allowed), which :mod:`paxcache.step` applies to
  the logits inside the jitted step. EOS is allowed only where the grammar accepts.
"""

from __future__ import annotations

import collections
import json
import logging
import threading
from collections.abc import Collection, Sequence
from typing import Any

import numpy as np

from paxcache.errors import PaxcacheError
from paxcache.sampling import StructuredOutputsParams

__all__ = [
    "GrammarCompiler",
    "GrammarError",
    "GrammarUnavailableError",
    "Matcher",
    "available",
    "bitmask_words",
    "fill_bitmask",
    "grammar_source",
    "validate",
]

logger = logging.getLogger(__name__)

JSON_OPTIONS = {"whitespace_flexible": False}
"""llguidance JSON compile options: compact JSON (``", "`` and ``": "`` separators, no free
whitespace), so a sampled document cannot wander off into whitespace forever."""

MAX_CACHED_GRAMMARS = 256
"""Compiled grammar texts kept per :class:`GrammarCompiler` (LRU)."""


class GrammarError(PaxcacheError, ValueError):
    """A constraint the grammar library rejects (the message says why)."""


class GrammarUnavailableError(GrammarError):
    """Constrained decoding was asked for but llguidance is not installed."""


def _llg() -> Any:
    try:
        import llguidance
        import llguidance.numpy  # noqa: F401 - the bitmask helpers (a submodule)
    except ImportError:
        raise GrammarUnavailableError(
            "structured outputs need the llguidance package, which is not installed "
            "(pip install 'paxcache[structured]')"
        ) from None
    return llguidance


def available() -> bool:
    """True when llguidance can be imported."""
    try:
        _llg()
    except GrammarUnavailableError:
        return False
    return True


def bitmask_words(vocab_size: int) -> int:
    """32-bit words per row of an allowed-token bitmask of ``vocab_size`` tokens."""
    return (vocab_size + 31) // 32


def grammar_source(spec: StructuredOutputsParams) -> str:
    """The llguidance grammar text of a constraint (not yet checked: see :func:`validate`).

    Raises:
      GrammarError: the JSON schema is not a JSON object; GrammarUnavailableError.
    """
    matcher = _llg().LLMatcher
    if spec.json is not None or spec.json_object:
        schema: Any = {"type": "object"} if spec.json_object else spec.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except (json.JSONDecodeError, RecursionError) as e:
                raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(f"a JSON schema must be an object, got {type(schema).__name__}")
        try:
            return matcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        except (ValueError, TypeError, RecursionError) as e:
            raise GrammarError(f"invalid JSON schema: {e}") from None
    if spec.regex is not None:
        return matcher.grammar_from_regex(spec.regex)
    return matcher.grammar_from_lark(spec.grammar)


def validate(spec: StructuredOutputsParams) -> str:
    """Compiles a constraint without a tokenizer and returns its grammar text.

    Raises:
      GrammarError: naming what the library rejects (an unsupported schema keyword, a bad
        regex, a grammar that does not parse); GrammarUnavailableError.
    """
    src = grammar_source(spec)
    err = _llg().LLMatcher.validate_grammar(src)
    if err:
        what = "JSON schema" if spec.json is not None else "regex" if spec.regex else "grammar"
        raise GrammarError(f"invalid {what}: {err}")
    return src


class _ByteTokens:
    """The byte-level tokenizer as llguidance's ``TokenizerWrapper`` expects it: the bytes of
    every token id, the special ids, and an encoder."""

    def __init__(self, tokenizer: Any, vocab_size: int) -> None:
        specials = {
            int(t)
            for t in (
                getattr(tokenizer, "bos_token_id", None),
                getattr(tokenizer, "eos_token_id", None),
                getattr(tokenizer, "pad_token_id", None),
            )
            if t is not None
        }
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.tokens = [
            bytes([i]) if i < 256 else f"<|special_{i}|>".encode() for i in range(vocab_size)
        ]
        self.special_token_ids = sorted(specials | set(range(256, vocab_size)))

    def __call__(self, s: bytes | str) -> list[int]:
        return list(s if isinstance(s, bytes) else s.encode("utf-8"))


def _ll_tokenizer(tokenizer: Any, vocab_size: int, eos_ids: Sequence[int]) -> Any:
    """An ``LLTokenizer`` for one of the project's tokenizers, ``vocab_size`` ids wide."""
    llg = _llg()
    eos = list(eos_ids) or None
    tokenizer_json = getattr(tokenizer, "tokenizer_json", None)
    if tokenizer_json is not None:  # HFTokenizer: the tokenizers library's own JSON
        return llg.LLTokenizer(tokenizer_json(), n_vocab=vocab_size, eos_token=eos)
    if hasattr(tokenizer, "decode_bytes"):  # ByteTokenizer
        wrapped = llg.TokenizerWrapper(_ByteTokens(tokenizer, vocab_size))
        return llg.LLTokenizer(wrapped, n_vocab=vocab_size, eos_token=eos)
    raise GrammarError(
        f"structured outputs are not supported for the tokenizer {type(tokenizer).__name__}"
    )


class Matcher:
    """One sequence's state in its grammar (an ``LLMatcher``)."""

    def __init__(self, ll_matcher: Any) -> None:
        self._m = ll_matcher

    @property
    def error(self) -> str | None:
        """Why the matcher failed (a token outside the grammar), None while it is fine."""
        return self._m.get_error() or None if self._m.is_error() else None

    def consume(self, token: int) -> bool:
        """Advances past a generated token; False (and :attr:`error` set) if the grammar
        does not allow it."""
        return bool(self._m.consume_token(int(token)))

    def is_accepting(self) -> bool:
        """The tokens so far form a complete output (EOS is allowed now)."""
        return bool(self._m.is_accepting())

    def is_stopped(self) -> bool:
        """No token but EOS can follow: the output is complete and cannot grow."""
        return bool(self._m.is_stopped())

    def fill(self, bitmask: np.ndarray, row: int) -> None:
        """Writes this matcher's allowed tokens into ``bitmask[row]`` (``i32[R, W]``)."""
        _llg().numpy.fill_next_token_bitmask(self._m, bitmask, row)


PARALLEL_FILL_MIN_VOCAB = 16384
"""Vocabularies at least this wide fill their rows in llguidance's thread pool; below it a
row takes microseconds and the pool's hand-off costs more than it saves (measured with
``scripts/bench_structured.py``: 32 rows of the 259-token tiny model, 0.5 ms in a loop vs
1.3 ms in the pool on 2 cores)."""


def fill_bitmask(rows: Sequence[tuple[Matcher, int]], bitmask: np.ndarray) -> None:
    """Fills ``bitmask[row]`` (``i32[R, W]``) for each ``(matcher, row)``: one by one, or,
    for a wide vocabulary, several at once in llguidance's thread pool (it drops the GIL)."""
    if len(rows) == 1 or bitmask.shape[1] * 32 < PARALLEL_FILL_MIN_VOCAB:
        for m, r in rows:
            m.fill(bitmask, r)
        return
    llg = _llg()
    llg.numpy.fill_next_token_bitmask_par(_executor(), [(m._m, r) for m, r in rows], bitmask)


_EXECUTOR: Any = None
_EXECUTOR_LOCK = threading.Lock()


def _executor() -> Any:
    global _EXECUTOR
    with _EXECUTOR_LOCK:
        if _EXECUTOR is None:
            _EXECUTOR = _llg().LLExecutor()
        return _EXECUTOR


class GrammarCompiler:
    """Makes :class:`Matcher` s for one engine's tokenizer and vocabulary.

    Cheap to construct: llguidance is imported, and the tokenizer wrapped, on the first
    constrained request.

    Args:
      tokenizer: the engine's tokenizer (``HFTokenizer`` or ``ByteTokenizer``).
      vocab_size: V, the model's vocabulary (its logits' width; ids the tokenizer lacks are
        never allowed).
      eos_token_ids: the ids that end a sequence (allowed only where the grammar accepts).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Collection[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.eos_token_ids = sorted(int(t) for t in eos_token_ids)
        self._ll_tok: Any = None
        self._cache: collections.OrderedDict[str, str] = collections.OrderedDict()
        self._lock = threading.Lock()

    def _tokenizer(self) -> Any:
        if self._ll_tok is None:
            self._ll_tok = _ll_tokenizer(self.tokenizer, self.vocab_size, self.eos_token_ids)
        return self._ll_tok

    def grammar(self, spec: StructuredOutputsParams) -> str:
        """The validated grammar text of ``spec`` (cached).

        Raises:
          GrammarError: the library rejects it; GrammarUnavailableError.
        """
        key = spec.key()
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                return self._cache[key]
        src = validate(spec)
        with self._lock:
            self._cache[key] = src
            while len(self._cache) > MAX_CACHED_GRAMMARS:
                self._cache.popitem(last=False)
        return src

    def matcher(self, spec: StructuredOutputsParams) -> Matcher:
        """A fresh matcher at the start of ``spec``'s grammar.

        Raises:
          GrammarError: the grammar cannot be built for this tokenizer.
        """
        src = self.grammar(spec)
        m = _llg().LLMatcher(self._tokenizer(), src, log_level=0)
        if m.is_error():
            raise GrammarError(f"the constraint cannot be compiled: {m.get_error()}")
        return Matcher(m)

    def factory(self, spec: StructuredOutputsParams | None) -> Any:
        """``make_matcher`` for :func:`paxcache.sequence.new_request`: a new matcher per
        sequence (``n > 1``: one each), or None without a constraint. Compiles once here, so
        a bad constraint raises now, before the request is queued."""
        if spec is None:
            return lambda: None
        first = self.matcher(spec)
        made = [first]

        def make() -> Matcher:
            return made.pop() if made else self.matcher(spec)

        return make
