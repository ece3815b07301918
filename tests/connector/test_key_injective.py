"""A chunk key is an injective function of everything it covers (issue 44, defect 2).

Engines serving ``llama@prod`` and ``llama_prod`` once shared every chunk key (the connector folded ``@`` into
``_``) and could load each other's KV as a hit. Every text field of a key -- the model name, the KV format, a
part's name -- is percent-encoded (every character outside printable ASCII, the ``@`` separator, the ``%``
escape itself, and ``/`` in the format and part fields), so distinct inputs never give one key, and names that
were already safe keep the keys they had (stored chunks still hit).
"""

from __future__ import annotations

from urllib.parse import unquote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvctl.connector.ownership import ChunkParts, chunk_keys, key_extra, key_field, part_key

CT = 4
#: pieces the adversarial names are made of: the key's separators, the escape, what a lossy mapping folds
#: them into, escapes spelled out, the worker field, spaces, controls, unicode, a lone surrogate
PIECES = ["@", "_", "%", "/", ":", " ", "\t", "\x00", "\n", "a", "b", "40", "%40", "%25", "%2F", "@w0", "w0", "é",
          "\u00e9", "e\u0301", "\U0001f600", "\ud800", "\ufeff", "+", "\\", "*", "?", "~"]
names = st.lists(st.sampled_from(PIECES), max_size=6).map("".join)
salts = st.none() | st.lists(st.sampled_from(PIECES), min_size=1, max_size=4).map("".join)
tokens = st.lists(st.integers(0, 5), min_size=1, max_size=9)
loras = st.none() | st.tuples(names, names)
images = st.none() | st.tuples(names, st.integers(0, 8), st.integers(1, 3))
#: (model, fmt, part or None, cache_salt or None, LoRA (name, path) or None, image or None, tokens): what one
#: stored value's key covers
inputs = st.tuples(names, names, st.none() | names.filter(bool), salts, loras, images, tokens.map(tuple)).filter(
    lambda c: c[5] is None or c[5][1] < len(c[6]))  # an image's placeholder starts inside the prompt, as in vLLM


def key_of(model: str, fmt: str, part: str | None, salt: str | None, lora, image, toks: tuple[int, ...]) -> str:
    """The key of the last chunk of ``toks`` (it covers every token), or of one part of that chunk."""
    extra = key_extra(CT, cache_salt=salt, lora=lora, mm=[image] if image else ())
    key = chunk_keys(list(toks), CT, model, fmt, extra)[-1]
    return part_key(key, part) if part is not None else key


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(inputs, min_size=2, max_size=24, unique=True))
def test_distinct_inputs_never_share_a_key(cases):
    keys = [key_of(*c) for c in cases]
    assert len(set(keys)) == len(cases), [(c, k) for c, k in zip(cases, keys) if keys.count(k) > 1]


@settings(max_examples=300, deadline=None)
@given(names, names)
def test_the_model_and_format_fields_decode_back_to_the_names(model, fmt):
    """The key's text is reversible: its fields give back the exact model name and format."""
    (key,) = chunk_keys([1, 2, 3, 4], CT, model, fmt)
    m, f, w, digest = key.split("@")
    assert unquote(m, errors="surrogatepass") == model and unquote(f, errors="surrogatepass") == fmt
    assert w == "w0" and len(digest) == 32 and "/" not in f
    assert key.isascii() and key.isprintable() and " " not in key


@pytest.mark.parametrize("a,b", [
    ("llama@prod", "llama_prod"),  # the defect: @ folded into _
    ("llama@prod", "llama%40prod"),  # an escape spelled out by hand is not the character
    ("llama%40prod", "llama%2540prod"),
    ("a@b", "a%b"),
    ("a b", "a_b"),
    ("caf\u00e9", "cafe\u0301"),  # two spellings of one word are two names (no normalisation folds them)
    ("m\x00", "m"),
])
def test_names_that_a_lossy_mapping_folds_stay_apart(a, b):
    ka, kb = chunk_keys(list(range(8)), CT, a, "f"), chunk_keys(list(range(8)), CT, b, "f")
    assert not set(ka) & set(kb)


def test_a_separator_in_one_field_cannot_pose_as_another_field():
    toks = list(range(4))
    assert chunk_keys(toks, CT, "m@f", "g") != chunk_keys(toks, CT, "m", "f@g")
    assert chunk_keys(toks, CT, "m@f@w0", "g") != chunk_keys(toks, CT, "m", "f@w0@g")
    (plain,) = chunk_keys(toks, CT, "m", "f/latent")
    (chunk,) = chunk_keys(toks, CT, "m", "f")
    assert plain != part_key(chunk, "latent")  # a format holding "/" is not a part of another format
    assert part_key(chunk, "a/b") != part_key(chunk, "a_b") != part_key(chunk, "a%2Fb")
    with pytest.raises(ValueError):
        part_key(part_key(chunk, "latent"), "indexer")  # a part key is not a chunk key
    with pytest.raises(ValueError):
        part_key(chunk, "")


def test_safe_names_keep_the_keys_stored_before():
    """Names of printable ASCII without '@' or '%' (and formats without '/') are their own key fields: a tier
    filled before this change still hits (digests written by the release before the escaping)."""
    assert chunk_keys(list(range(10)), CT, "meta-llama/Llama-3.1-8B-Instruct", "mla576-L61-bfloat16") == [
        "meta-llama/Llama-3.1-8B-Instruct@mla576-L61-bfloat16@w0@c6d82ce4018828e66b3de15bffc6767b",
        "meta-llama/Llama-3.1-8B-Instruct@mla576-L61-bfloat16@w0@36116417951a8e3abf39b161dd9acbd8",
        "meta-llama/Llama-3.1-8B-Instruct@mla576-L61-bfloat16@w0@dff634e70885001adfd2fe07bdcd0bb9"]
    (key,) = chunk_keys(list(range(4)), CT, "glm-5:fp8", "mla656-L2-fp8_ds_mla+idx132-L2-fp8_e4m3",
                        key_extra(CT, cache_salt="s"))
    assert key == "glm-5:fp8@mla656-L2-fp8_ds_mla+idx132-L2-fp8_e4m3@w0@48cfbdc229f05b907767a7e9efd128b0"
    assert part_key(key, "indexer") == (
        "glm-5:fp8@mla656-L2-fp8_ds_mla+idx132-L2-fp8_e4m3/indexer@w0@48cfbdc229f05b907767a7e9efd128b0")
    assert chunk_keys(list(range(4)), CT, "llama_prod", "gqa8x128-L32-bfloat16") == [
        "llama_prod@gqa8x128-L32-bfloat16@w0@60ff231e3bc1ea1bd6a39f3e37bddd61"]


@given(st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E).filter(lambda c: c not in "@%")))
def test_a_safe_name_is_its_own_field(name):
    assert key_field(name) == name
    assert key_field(name + "@") == name + "%40" and key_field("%") == "%25"


def test_every_part_name_gets_a_key_of_its_own():
    (chunk,) = chunk_keys(list(range(4)), CT, "m", "f")
    parts = ChunkParts(("a/b", "a_b", "a@b"), (1, 1, 1))
    assert len(set(parts.keys(chunk))) == 3
