"""Tokenizers: HF ``tokenizer.json`` via the ``tokenizers`` library, or a byte-level fallback.

Both implement the ``Tokenizer`` protocol: ``encode`` (``add_special_tokens=True`` adds BOS
the way HF ``tokenizer(text)`` does), ``decode``, ``bos_token_id``,
``eos_token_id``, ``vocab_size`` and ``apply_chat_template``; both also offer
``byte_decoder(skip_special_tokens)`` (ids -> the bytes whose UTF-8 decoding is their text; an
HF tokenizer only when its decoder is ``ByteLevel``), which lets ``IncrementalDecoder``
(:mod:`paxcache.models.detokenizer`, re-exported here) decode each id's bytes once.

Chat templates come from the checkpoint (``tokenizer_config.json``), so they are untrusted
code: they are rendered in jinja2's ``ImmutableSandboxedEnvironment`` (as transformers does)
with the same helpers transformers provides (``raise_exception``, ``strftime_now``, a
``tojson`` filter, ``{% break %}``/``{% continue %}``, ``{% generation %}``), plus budgets on
``range``, on ``*``/``**`` results and on the rendered length. Any failure is a
:class:`ChatTemplateError`; a template never reaches Python internals (``__globals__``,
``__subclasses__``, ...).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from paxcache.errors import CheckpointError, PaxcacheError
from paxcache.models.detokenizer import MAX_HELD_TOKENS, IncrementalDecoder

__all__ = [
    "MAX_HELD_TOKENS",
    "ByteTokenizer",
    "ChatTemplateError",
    "HFTokenizer",
    "IncrementalDecoder",
    "Tokenizer",
    "load_tokenizer",
]

logger = logging.getLogger(__name__)

MAX_TEMPLATE_OUTPUT_CHARS = 4 << 20
"""Longest rendered chat prompt (characters); a template that writes more fails."""

MAX_TEMPLATE_RANGE_ITEMS = 1 << 20
"""Total items all ``range()`` calls of one template rendering may produce."""

MAX_TEMPLATE_SEQUENCE_LEN = 1 << 20
"""Longest string or list a template may build with ``*`` (and largest ``**`` result bits)."""

_MAX_TOKENIZER_CONFIG_BYTES = 64 << 20


class ChatTemplateError(PaxcacheError):
    """A chat template failed to compile or render.

    Attributes:
      public_message: what a client may be told (no paths, no Python internals).
      client_error: True when the template itself rejected the messages (its
        ``raise_exception``: e.g. roles that do not alternate), i.e. the request is at fault;
        False when the template is broken or tried something the sandbox refuses.
    """

    def __init__(self, message: str, *, public_message: str, client_error: bool) -> None:
        super().__init__(message)
        self.public_message = public_message
        self.client_error = client_error


Message = Mapping[str, str]

SIMPLE_CHAT_TEMPLATE_DOC = """Fallback chat template (no jinja2 or no template in the checkpoint):

    <|role|>\\n{content}\\n   for each message, then   <|assistant|>\\n   when
    add_generation_prompt is true.
"""


def simple_chat_template(
    messages: Sequence[Message],
    add_generation_prompt: bool = True,
    tools: Sequence[Mapping[str, Any]] | None = None,
) -> str:
    """Renders messages as ``<|role|>\\ncontent\\n`` blocks plus ``<|assistant|>\\n``.

    With ``tools``, a ``<|tools|>\\n[...]\\n`` block (their JSON) comes first; an assistant
    message's ``tool_calls`` follow its content as ``<tool_call>{"name", "arguments"}
    </tool_call>`` lines (the Hermes format the server parses back)."""
    parts = [f"<|tools|>\n{json.dumps(list(tools), ensure_ascii=False)}\n"] if tools else []
    for m in messages:
        text = m.get("content") or ""
        for call in m.get("tool_calls") or ():
            fn = call.get("function", call)
            body = {"name": fn.get("name"), "arguments": fn.get("arguments")}
            text += f"<tool_call>{json.dumps(body, ensure_ascii=False)}</tool_call>\n"
        parts.append(f"<|{m['role']}|>\n{text}\n")
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

    Used by the bundled tiny model. As an HF tokenizer does, text that spells a special token
    (``"<bos>"``, ``"<eos>"``, ``"<pad>"``) encodes to its id, whatever
    ``add_special_tokens`` says (that flag only adds BOS first). ``decode`` replaces invalid
    UTF-8 and drops special ids, or spells them with ``skip_special_tokens=False``.
    :meth:`tokenizer_json` is the same tokenizer as an HF ``tokenizer.json`` (the bundled
    model ships it, so ``tokenizers`` and ``transformers.AutoTokenizer`` load it).
    """

    def __init__(
        self,
        bos_token_id: int = 256,
        eos_token_id: int = 257,
        pad_token_id: int = 258,
        special_tokens: tuple[str, str, str] = ("<bos>", "<eos>", "<pad>"),
    ) -> None:
        self._bos, self._eos, self._pad = bos_token_id, eos_token_id, pad_token_id
        self._vocab = max(256, bos_token_id + 1, eos_token_id + 1, pad_token_id + 1)
        ids = (bos_token_id, eos_token_id, pad_token_id)
        self.bos_token, self.eos_token, self.pad_token = special_tokens
        self._special_ids = {
            name: i for name, i in zip(special_tokens, ids, strict=True) if i >= 256
        }
        self._special_names = {i: name for name, i in self._special_ids.items()}
        alternatives = sorted(self._special_ids, key=len, reverse=True)
        self._special_re = re.compile("|".join(map(re.escape, alternatives)))

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
        """Text -> UTF-8 byte ids (a special token's spelling -> its id), with BOS first when
        ``add_special_tokens``."""
        ids = [self._bos] if add_special_tokens else []
        start = 0
        for m in self._special_re.finditer(text) if self._special_ids else ():
            ids.extend(text[start : m.start()].encode("utf-8"))
            ids.append(self._special_ids[m.group()])
            start = m.end()
        ids.extend(text[start:].encode("utf-8"))
        return ids

    def decode_bytes(self, ids: Sequence[int]) -> bytes:
        """Ids -> raw bytes, dropping ids >= 256 (specials)."""
        if type(ids) is not list and type(ids) is not tuple:
            ids = list(map(int, ids))  # an array: bytes() would copy its buffer, not its ids
        if not ids or max(ids) < 256:
            try:  # the common case, every id a byte: one C call
                return bytes(ids)
            except (ValueError, TypeError):  # a negative id, or not an integer
                pass
        # Specials (or a model whose vocabulary is larger than the bytes, such as bench_host's
        # micro model): a list comprehension, half the time of raising and filtering here.
        try:
            return bytes([i for i in ids if 0 <= i < 256])
        except TypeError:  # ids that are not integers but convert to them
            return bytes([i for i in map(int, ids) if 0 <= i < 256])

    def byte_decoder(self, skip_special_tokens: bool = True) -> Callable[[Sequence[int]], bytes]:
        """Ids -> the bytes whose UTF-8 decoding (``errors="replace"``) is their text, as
        :meth:`decode` gives it: a special id is dropped, or spelled with
        ``skip_special_tokens=False`` (its spelling starts a new character, so text around
        it decodes as in :meth:`decode`'s separate runs); other ids >= 256 are dropped."""
        if skip_special_tokens:
            return self.decode_bytes
        names = {i: name.encode("utf-8") for i, name in self._special_names.items()}

        def spelled(ids: Sequence[int]) -> bytes:
            try:
                return bytes(ids)
            except (ValueError, TypeError):
                return b"".join(
                    names.get(i, b"") if not 0 <= i < 256 else bytes((i,)) for i in map(int, ids)
                )

        return spelled

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text; invalid UTF-8 becomes U+FFFD. Special ids are dropped, or spelled
        (``"<bos>"``) with ``skip_special_tokens=False``; other ids >= 256 are dropped."""
        if skip_special_tokens or not any(int(i) in self._special_names for i in ids):
            return self.decode_bytes(ids).decode("utf-8", errors="replace")
        parts, run = [], []
        for i in map(int, ids):
            if i in self._special_names:
                parts += [bytes(run).decode("utf-8", errors="replace"), self._special_names[i]]
                run = []
            elif 0 <= i < 256:
                run.append(i)
        parts.append(bytes(run).decode("utf-8", errors="replace"))
        return "".join(parts)

    def tokenizer_json(self) -> str:
        """This tokenizer as an HF ``tokenizer.json``: byte-level BPE without merges (byte
        ``b`` is id ``b``), the special tokens as added tokens, a post-processor that puts BOS
        first. ``tokenizers`` encodes and decodes with it exactly as this class does."""
        byte_chars = _byte_level_chars()
        specials = sorted(self._special_names.items())
        doc = {
            "version": "1.0",
            "truncation": None,
            "padding": None,
            "added_tokens": [
                {
                    "id": i,
                    "content": name,
                    "single_word": False,
                    "lstrip": False,
                    "rstrip": False,
                    "normalized": False,
                    "special": True,
                }
                for i, name in specials
            ],
            "normalizer": None,
            "pre_tokenizer": {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
            "post_processor": {
                "type": "TemplateProcessing",
                "single": [
                    {"SpecialToken": {"id": self.bos_token, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                ],
                "pair": [
                    {"SpecialToken": {"id": self.bos_token, "type_id": 0}},
                    {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}},
                ],
                "special_tokens": {
                    self.bos_token: {
                        "id": self.bos_token,
                        "ids": [self._bos],
                        "tokens": [self.bos_token],
                    }
                },
            },
            "decoder": {
                "type": "ByteLevel",
                "add_prefix_space": False,
                "trim_offsets": False,
                "use_regex": False,
            },
            "model": {
                "type": "BPE",
                "dropout": None,
                "unk_token": None,
                "continuing_subword_prefix": None,
                "end_of_word_suffix": None,
                "fuse_unk": False,
                "byte_fallback": False,
                "ignore_merges": False,
                "vocab": {byte_chars[b]: b for b in range(256)},
                "merges": [],
            },
        }
        return json.dumps(doc, ensure_ascii=False, indent=2) + "\n"

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """See ``SIMPLE_CHAT_TEMPLATE_DOC``."""
        return simple_chat_template(messages, add_generation_prompt, tools)


def _byte_level_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte 0..255
    (printable Latin-1 bytes stand for themselves, the others for ``chr(256 + k)``)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, extra, keep = [], 0, set(printable)
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


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
        tok_path = path / "tokenizer.json"
        try:
            self._tok = _HFTok.from_file(str(tok_path))
        except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exceptions
            raise CheckpointError(f"{tok_path}: not a valid tokenizer.json: {e}") from None
        cfg_path = path / "tokenizer_config.json"
        self.config: dict[str, Any] = _read_tokenizer_config(cfg_path)
        self.template_source = f"{cfg_path.name}: chat_template"
        self.chat_template = _pick_chat_template(self.config.get("chat_template"), cfg_path)
        self._template: Any = None  # compiled on first use
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
        # Other special tokens a template may reference (as transformers passes them).
        self._byte_tables: dict[bool, dict[int, bytes]] = {}  # byte_decoder's, built on use
        self._special_tokens = {
            name: _token_content(self.config.get(name)) or ""
            for name in ("unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
        }

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

    def byte_decoder(
        self, skip_special_tokens: bool = True
    ) -> Callable[[Sequence[int]], bytes] | None:
        """Ids -> the bytes whose UTF-8 decoding (``errors="replace"``) is :meth:`decode`'s
        text; None unless the tokenizer.json's decoder is ``ByteLevel``.

        ``tokenizers``' ``ByteLevel`` decoder maps each token's characters back to bytes
        through GPT-2's byte alphabet (a token with a character outside it: its UTF-8, added
        tokens included) and decodes the concatenation with replacement; a skipped special
        token and an unknown id add nothing. The same as a table from id to bytes, built on
        first use (once per ``skip_special_tokens``).
        """
        from tokenizers import decoders

        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        table = self._byte_tables.get(skip_special_tokens)
        if table is None:
            byte_of = {c: b for b, c in enumerate(_byte_level_chars())}
            specials = {i for i, t in self._tok.get_added_tokens_decoder().items() if t.special}
            table = {}
            for token, i in self._tok.get_vocab(with_added_tokens=True).items():
                if skip_special_tokens and i in specials:
                    continue
                try:
                    table[i] = bytes([byte_of[c] for c in token])
                except KeyError:
                    table[i] = token.encode("utf-8")
            self._byte_tables[skip_special_tokens] = table
        get = table.get

        def to_bytes(ids: Sequence[int]) -> bytes:
            return b"".join([get(i, b"") for i in ids])

        return to_bytes

    def tokenizer_json(self) -> str:
        """The ``tokenizers`` library's JSON of this tokenizer (what grammar libraries read)."""
        return self._tok.to_str()

    def apply_chat_template(
        self,
        messages: Sequence[Message],
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> str:
        """Renders the checkpoint's jinja ``chat_template`` in a sandbox (see the module
        docstring). ``tools`` (OpenAI's ``{"type": "function", "function": {...}}`` dicts)
        reach the template as its ``tools`` variable, as transformers passes them.

        Falls back to ``simple_chat_template`` (see ``SIMPLE_CHAT_TEMPLATE_DOC``) when the
        checkpoint has no template or jinja2 is not installed.

        Raises:
          ChatTemplateError: the template does not compile, rejects the messages
            (``raise_exception``), or fails or is stopped by the sandbox while rendering.
        """
        if not self.chat_template:
            return simple_chat_template(messages, add_generation_prompt, tools)
        try:
            import jinja2  # noqa: F401
        except ImportError:
            logger.warning("jinja2 not installed; using the simple chat template")
            return simple_chat_template(messages, add_generation_prompt, tools)
        if self._template is None:
            self._template = compile_chat_template(self.chat_template, self.template_source)
        return render_chat_template(
            self._template,
            self.template_source,
            messages=[dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tools=[dict(t) for t in tools] if tools else None,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
            **self._special_tokens,
        )


def _read_tokenizer_config(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        if path.stat().st_size > _MAX_TOKENIZER_CONFIG_BYTES:
            raise CheckpointError(
                f"{path}: larger than {_MAX_TOKENIZER_CONFIG_BYTES >> 20} MiB; refusing to read it"
            )
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise CheckpointError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: must hold a JSON object, got {type(cfg).__name__}")
    return cfg


def _pick_chat_template(value: Any, cfg_path: Path) -> str | None:
    """The default chat template from ``tokenizer_config.json``'s ``chat_template`` field (a
    string, or HF's list of ``{"name", "template"}``)."""
    if value is None or isinstance(value, str):
        return value or None
    if isinstance(value, list):
        named = {
            t.get("name"): t.get("template")
            for t in value
            if isinstance(t, dict) and isinstance(t.get("template"), str)
        }
        picked = named.get("default") or next(iter(named.values()), None)
        if picked is not None:
            return picked
    raise CheckpointError(
        f"{cfg_path}: field chat_template must be a string or a list of "
        f'{{"name", "template"}} objects, got {type(value).__name__}'
    )


# ----------------------------------------------------------------------------------------------
# Sandboxed chat templates


def _template_error(source: str, what: str, detail: str, *, client_error: bool = False) -> Any:
    return ChatTemplateError(
        f"chat template ({source}) {what}: {detail}",
        public_message=f"the model's chat template ({source}) {what}"
        + (f": {detail}" if client_error else ""),
        client_error=client_error,
    )


class _TemplateRejected(Exception):
    """Raised by a template's ``raise_exception(msg)``."""


def _make_environment() -> Any:
    """An ``ImmutableSandboxedEnvironment`` with transformers' chat-template helpers and
    budgets on the operations that could otherwise exhaust memory or CPU."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(Extension):
        """``{% generation %}...{% endgeneration %}`` (transformers marks assistant text with
        it for training masks); renders its body unchanged."""

        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class ChatSandbox(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            if operator == "**":
                if isinstance(left, int) and isinstance(right, int):
                    bits = abs(left).bit_length() * max(right, 0)
                    if bits > MAX_TEMPLATE_SEQUENCE_LEN:
                        raise jinja2.sandbox.SecurityError("'**' result too large")
                return super().call_binop(context, operator, left, right)
            for seq, times in ((left, right), (right, left)):
                if (
                    isinstance(seq, (str, list, tuple))
                    and isinstance(times, int)
                    and len(seq) * times > MAX_TEMPLATE_SEQUENCE_LEN
                ):
                    raise jinja2.sandbox.SecurityError("'*' result too long")
            return super().call_binop(context, operator, left, right)

    env = ChatSandbox(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, loopcontrols],
    )

    def raise_exception(message: Any) -> None:
        raise _TemplateRejected(str(message))

    def tojson(
        x: Any,
        ensure_ascii: bool = False,
        indent: int | None = None,
        separators: Any = None,
        sort_keys: bool = False,
    ) -> str:
        # As transformers: no HTML escaping (jinja's own tojson escapes <, >, &, ').
        if indent is not None and (not isinstance(indent, int) or not 0 <= indent <= 16):
            raise jinja2.sandbox.SecurityError("tojson indent must be an int in [0, 16]")
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(str(fmt))

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def compile_chat_template(template: str, source: str = "chat_template") -> Any:
    """Compiles a checkpoint's chat template in the sandbox.

    Args:
      template: the jinja source.
      source: where it came from, for messages (e.g. ``"tokenizer_config.json: chat_template"``).

    Returns:
      a ``jinja2.Template`` bound to a fresh sandboxed environment.

    Raises:
      ChatTemplateError: the template does not compile.
    """
    import jinja2

    env = _make_environment()
    try:
        return env.from_string(template)
    except (jinja2.TemplateError, RecursionError, MemoryError, ValueError, TypeError) as e:
        raise _template_error(source, "does not compile", f"{type(e).__name__}: {e}") from None


def render_chat_template(template: Any, source: str = "chat_template", **context: Any) -> str:
    """Renders a template from :func:`compile_chat_template` within the module's budgets.

    Raises:
      ChatTemplateError: ``client_error=True`` when the template called
        ``raise_exception(msg)`` (the messages are at fault); otherwise the template failed or
        the sandbox stopped it (an unsafe attribute, a budget exceeded).
    """
    import jinja2
    from jinja2.sandbox import SecurityError

    budget = [MAX_TEMPLATE_RANGE_ITEMS]
    sandbox_range = template.environment.globals["range"]

    def budgeted_range(*args: Any) -> Any:
        r = sandbox_range(*args)
        budget[0] -= len(r)
        if budget[0] < 0:
            raise SecurityError(f"range() budget of {MAX_TEMPLATE_RANGE_ITEMS} items exceeded")
        return r

    parts: list[str] = []
    size = 0
    try:
        for piece in template.generate(range=budgeted_range, **context):
            size += len(piece)
            if size > MAX_TEMPLATE_OUTPUT_CHARS:
                raise SecurityError(f"output longer than {MAX_TEMPLATE_OUTPUT_CHARS} characters")
            parts.append(piece)
    except _TemplateRejected as e:
        raise _template_error(source, "rejected the messages", str(e), client_error=True) from None
    except SecurityError as e:
        raise _template_error(source, "was stopped by the sandbox", str(e)) from None
    except (jinja2.TemplateError, RecursionError, MemoryError, ArithmeticError) as e:
        raise _template_error(source, "failed to render", f"{type(e).__name__}: {e}") from None
    except (TypeError, ValueError, LookupError, AttributeError) as e:
        raise _template_error(source, "failed to render", f"{type(e).__name__}: {e}") from None
    return "".join(parts)


def load_tokenizer(path: str | os.PathLike[str], config: Any | None = None) -> Tokenizer:
    """The tokenizer for a checkpoint directory.

    ``tokenizer.json`` -> ``HFTokenizer``; otherwise, or when ``tokenizer_config.json`` says
    ``"paxcache_tokenizer": "byte"`` (the bundled model: its ``tokenizer.json`` is the same
    tokenizer for HF clients), a ``ByteTokenizer`` whose special ids come from config.json
    (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) when set.
    """
    path = Path(path)
    bos = getattr(config, "bos_token_id", None)
    eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, tuple):
        eos = eos[0] if eos else None
    byte = _read_tokenizer_config(path / "tokenizer_config.json").get("paxcache_tokenizer")
    if (path / "tokenizer.json").is_file() and byte != "byte":
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
