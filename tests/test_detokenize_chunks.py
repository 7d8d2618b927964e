"""IncrementalDecoder: its text is the tokenizer's decode of the ids, on both paths (bytes, for
byte-level tokenizers; window, for the others), and push_chunk (multi-step decode detokenizes
each row's tokens at once) gives exactly what pushing the ids one by one gives, at the chunk's
end and for every later push and flush."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from paxcache.models import ByteTokenizer, HFTokenizer, load_pretrained
from paxcache.models.tokenizer import MAX_HELD_TOKENS, IncrementalDecoder


class _WindowOnly:
    """A tokenizer without ``byte_decoder``: the decoder takes its window path."""

    def __init__(self, tok):
        self._tok = tok

    def decode(self, ids, skip_special_tokens=True):
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _bpe(path):
    """``test_security``'s byte-level BPE tokenizer.json plus plain added tokens (one of them a
    Latin-1 character the byte alphabet maps to a lone byte)."""
    from test_security import _bpe_tokenizer
    from tokenizers import AddedToken, Tokenizer

    _bpe_tokenizer(path, None)
    tk = Tokenizer.from_file(str(path / "tokenizer.json"))
    tk.add_tokens([AddedToken("é", special=False), AddedToken("<tool>", special=False)])
    tk.save(str(path / "tokenizer.json"))
    return HFTokenizer(path)


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    _, tiny = load_pretrained("tiny")
    bpe = _bpe(tmp_path_factory.mktemp("bpe"))
    return {
        "bytes": ByteTokenizer(),
        "tiny": tiny,
        "bpe": bpe,
        "window_bytes": _WindowOnly(ByteTokenizer()),
        "window_bpe": _WindowOnly(bpe),
    }


# Byte ids make incomplete UTF-8 characters; ids >= 256 are the tiny tokenizer's pieces.
_ids = st.one_of(st.integers(0, 255), st.integers(0, 1023), st.sampled_from([0xE2, 0x82, 0xAC]))
_chunks = st.lists(st.lists(_ids, min_size=1, max_size=MAX_HELD_TOKENS + 2), max_size=12)


@settings(max_examples=150, deadline=None)
@given(
    which=st.sampled_from(["bytes", "tiny", "bpe", "window_bytes", "window_bpe"]),
    chunks=_chunks,
    tail=st.lists(_ids, max_size=4),
)
def test_a_chunk_gives_the_text_of_one_by_one_pushes(tokenizers, which, chunks, tail):
    tok = tokenizers[which]
    if which in ("bytes", "window_bytes"):
        chunks = [[i % 256 for i in c] for c in chunks]
        tail = [i % 256 for i in tail]
    one, many = IncrementalDecoder(tok), IncrementalDecoder(tok)
    text_one = text_many = ""
    for chunk in chunks:
        text_one += "".join(one.push(i) for i in chunk)
        text_many += many.push_chunk(chunk)
        assert many.ids == one.ids
        assert text_many == text_one, chunk
    for i in tail:
        assert many.push(i) == one.push(i)
    assert many.flush() == one.flush()


@settings(max_examples=150, deadline=None)
@given(
    which=st.sampled_from(["bytes", "tiny", "bpe"]),
    skip=st.booleans(),
    chunks=_chunks,
)
@example(which="bytes", skip=False, chunks=[[0xED, 0xA0]])  # a surrogate's lead: CPython holds it
def test_the_byte_path_streams_a_prefix_of_the_full_decode_and_ends_with_it(
    tokenizers, which, skip, chunks
):
    """Byte-level tokenizers take the bytes path; after every chunk the text so far is a prefix
    of ``decode(all ids)`` (nothing emitted is ever wrong) that only an incomplete character's
    bytes (at most 3 ids here) separate from ``decode(ids so far)``, and the flush completes
    it, special ids dropped or spelled as ``decode`` does. Held bytes can decode to as many
    U+FFFD as there are bytes: CPython's incremental decoder holds ``ED A0`` (a surrogate's
    start, which ``surrogatepass`` would complete) where a whole decode gives two U+FFFD."""
    tok = tokenizers[which]
    dec = IncrementalDecoder(tok, skip_special_tokens=skip)
    assert dec.byte_level
    every = [i for c in chunks for i in c]
    full = tok.decode(every, skip_special_tokens=skip)
    text, seen = "", []
    for chunk in chunks:
        text += dec.push_chunk(chunk)
        seen += chunk
        assert full.startswith(text)
        so_far = tok.decode(seen, skip_special_tokens=skip)
        assert so_far.startswith(text) and len(so_far) - len(text) <= 3, (so_far, text)
    assert text + dec.flush() == full


def test_a_tokenizer_without_byte_level_decoding_takes_the_window_path(tokenizers, tmp_path):
    from tokenizers import Tokenizer, decoders, models

    assert not IncrementalDecoder(tokenizers["window_bytes"]).byte_level
    tk = Tokenizer(models.WordLevel({"a": 0, "b": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tk.decoder = decoders.WordPiece()
    tk.save(str(tmp_path / "tokenizer.json"))
    word = HFTokenizer(tmp_path)
    assert word.byte_decoder() is None
    dec = IncrementalDecoder(word)
    assert not dec.byte_level
    assert "".join(dec.push(i) for i in (0, 1, 0)) + dec.flush() == word.decode([0, 1, 0])


def test_plain_text_chunks_decode_at_once_and_held_characters_id_by_id(tokenizers):
    dec = IncrementalDecoder(tokenizers["window_bytes"])
    assert dec._chunk_at_once(list(b"hello ")) == "hello "
    assert dec._chunk_at_once([0xE2, 0x82]) is None  # would end inside a character
    assert dec.ids == list(b"hello ")
    assert dec.push_chunk([0xE2, 0x82]) == ""  # id by id: held back, as push would
    assert dec.ids == list(b"hello ") + [0xE2, 0x82]
    assert dec._chunk_at_once([0xAC]) is None  # something is held: id by id
    assert dec.push_chunk([0xAC, 0x21]) == "\u20ac!"
    assert dec._chunk_at_once(list(range(97, 97 + MAX_HELD_TOKENS + 1))) is None  # too long
    assert dec.push_chunk(list(range(97, 97 + MAX_HELD_TOKENS + 1))) == "abcdefghi"
