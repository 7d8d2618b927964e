"""IncrementalDecoder.push_chunk (multi-step decode detokenizes each row's tokens at once):
the text is exactly what pushing the ids one by one gives, at the chunk's end and for every
later push and flush, whether it decodes the chunk at once or id by id."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paxcache.models import ByteTokenizer, load_pretrained
from paxcache.models.tokenizer import MAX_HELD_TOKENS, IncrementalDecoder


@pytest.fixture(scope="module")
def tokenizers():
    _, tiny = load_pretrained("tiny")
    return {"bytes": ByteTokenizer(), "tiny": tiny}


# Byte ids make incomplete UTF-8 characters; ids >= 256 are the tiny tokenizer's pieces.
_ids = st.one_of(st.integers(0, 255), st.integers(0, 1023), st.sampled_from([0xE2, 0x82, 0xAC]))
_chunks = st.lists(st.lists(_ids, min_size=1, max_size=MAX_HELD_TOKENS + 2), max_size=12)


@settings(max_examples=150, deadline=None)
@given(which=st.sampled_from(["bytes", "tiny"]), chunks=_chunks, tail=st.lists(_ids, max_size=4))
def test_a_chunk_gives_the_text_of_one_by_one_pushes(tokenizers, which, chunks, tail):
    tok = tokenizers[which]
    if which == "bytes":
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


def test_plain_text_chunks_decode_at_once_and_held_characters_id_by_id(tokenizers):
    dec = IncrementalDecoder(tokenizers["bytes"])
    assert dec._chunk_at_once(list(b"hello ")) == "hello "
    assert dec._chunk_at_once([0xE2, 0x82]) is None  # would end inside a character
    assert dec.ids == list(b"hello ")
    assert dec.push_chunk([0xE2, 0x82]) == ""  # id by id: held back, as push would
    assert dec.ids == list(b"hello ") + [0xE2, 0x82]
    assert dec._chunk_at_once([0xAC]) is None  # something is held: id by id
    assert dec.push_chunk([0xAC, 0x21]) == "\u20ac!"
    assert dec._chunk_at_once(list(range(97, 97 + MAX_HELD_TOKENS + 1))) is None  # too long
    assert dec.push_chunk(list(range(97, 97 + MAX_HELD_TOKENS + 1))) == "abcdefghi"
