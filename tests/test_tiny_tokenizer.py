"""The bundled tiny model's ``tokenizer.json`` (paxcache/models/tiny) is the tokenizer paxcache
serves it with (``ByteTokenizer``): the ``tokenizers`` library loads it to the same ids on
every input (any text, special tokens spelled inside it, with and without BOS) and decodes
ids back to the same text. transformers loads it too (``AutoTokenizer``, class named in
``tokenizer_config.json``); that was checked by hand, transformers is not a test dependency."""

from __future__ import annotations

import json

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from paxcache.models.loading import TINY_DIR
from paxcache.models.tokenizer import ByteTokenizer, load_tokenizer

HF = Tokenizer.from_file(str(TINY_DIR / "tokenizer.json"))
OURS = ByteTokenizer()

# Text with special-token spellings (and near misses) mixed into arbitrary unicode.
PIECES = st.one_of(
    st.text(max_size=12),
    st.sampled_from(["<bos>", "<eos>", "<pad>", "<bo", "s>", "<", "<<eos>>", " ", "\n"]),
)
TEXTS = st.lists(PIECES, max_size=8).map("".join)


def test_bundled_tokenizer_json_is_the_byte_tokenizers():
    assert (TINY_DIR / "tokenizer.json").read_text(encoding="utf-8") == OURS.tokenizer_json()
    cfg = json.loads((TINY_DIR / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert (cfg["bos_token"], cfg["eos_token"], cfg["pad_token"]) == ("<bos>", "<eos>", "<pad>")
    assert isinstance(load_tokenizer(TINY_DIR), ByteTokenizer)  # served by paxcache's own
    assert HF.get_vocab_size() == OURS.vocab_size


@settings(max_examples=150, deadline=None)
@given(text=TEXTS, add_special_tokens=st.booleans())
def test_tokenizers_library_encodes_like_the_byte_tokenizer(text, add_special_tokens):
    got = HF.encode(text, add_special_tokens=add_special_tokens).ids
    assert got == OURS.encode(text, add_special_tokens=add_special_tokens)


@settings(max_examples=150, deadline=None)
@given(ids=st.lists(st.integers(0, OURS.vocab_size - 1), max_size=24), skip=st.booleans())
def test_tokenizers_library_decodes_like_the_byte_tokenizer(ids, skip):
    assert HF.decode(ids, skip_special_tokens=skip) == OURS.decode(ids, skip_special_tokens=skip)


def test_special_token_spellings_encode_to_their_ids():
    assert OURS.encode("a<eos>b<pad>", add_special_tokens=True) == [256, 97, 257, 98, 258]
    assert OURS.encode("<bo<bos>s>", add_special_tokens=False) == [60, 98, 111, 256, 115, 62]
    assert OURS.decode([256, 104, 257], skip_special_tokens=False) == "<bos>h<eos>"
    assert OURS.decode([256, 104, 257]) == "h"


@settings(max_examples=50, deadline=None)
@given(ids=st.lists(st.integers(0, 258), max_size=40), skip=st.booleans())
def test_byte_tokenizer_decodes_an_array_of_ids_as_their_list(ids, skip):
    """``decode`` of a numpy (or jax) array of ids is the text of the same ids as a list, not
    of the array's raw buffer; ids past the bytes (specials) are dropped in either form."""
    tok = ByteTokenizer()
    want = tok.decode(ids, skip_special_tokens=skip)
    for arr in (np.asarray(ids, np.int64), np.asarray(ids, np.int32)):
        assert tok.decode(arr, skip_special_tokens=skip) == want
        assert tok.decode_bytes(arr) == tok.decode_bytes(ids)
