"""What a chunk key covers beyond the tokens (KeyExtra): every chunk for seed material, from its chunk on for mm."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kvctl.connector.ownership import KeyExtra, chunk_keys, key_extra

TOKENS = list(range(10))  # chunks of 4: [0..3] [4..7] [8, 9]


def keys(extra=None, tokens=TOKENS):
    return chunk_keys(tokens, 4, "m", "f", extra)


def test_without_extras_the_keys_are_the_stored_ones():
    """Chunks stored before extras existed must still hit: the token-only key format is unchanged
    (these digests were written by the release before KeyExtra; a changed value means a format break)."""
    stored = ["m@f@w0@8ef45037cf3eb51ba75684786c3cc160", "m@f@w0@7f6e5c25b0188176949c69fdbdcbc318",
              "m@f@w0@a806535bde609d54597b234c6479ba7f"]
    assert keys() == keys(None) == keys(KeyExtra()) == stored
    assert key_extra(4) is None and key_extra(4, cache_salt="", lora=None, mm=()) is None


@pytest.mark.parametrize("extra", [dict(cache_salt="tenant-a"), dict(lora=("sql", "/adapters/sql"))])
def test_salt_and_lora_change_every_chunk(extra):
    plain, seeded = keys(), keys(key_extra(4, **extra))
    assert all(a != b for a, b in zip(plain, seeded, strict=True))
    assert keys(key_extra(4, **extra)) == seeded  # deterministic


def test_salt_and_lora_do_not_collide_with_each_other():
    a = keys(key_extra(4, cache_salt="x"))
    b = keys(key_extra(4, lora=("x", "")))
    c = keys(key_extra(4, cache_salt="x", lora=("x", "")))
    assert len({a[0], b[0], c[0]}) == 3


def test_an_mm_input_changes_the_keys_from_the_first_chunk_it_touches():
    plain = keys()
    img = keys(key_extra(4, mm=[("red", 5, 2)]))  # tokens 5, 6: chunk 1
    assert img[0] == plain[0] and img[1] != plain[1] and img[2] != plain[2]
    other = keys(key_extra(4, mm=[("blue", 5, 2)]))
    assert other[0] == plain[0] and other[1:] != img[1:] and other[2] != img[2]
    moved = keys(key_extra(4, mm=[("red", 6, 2)]))  # the same image one token later
    assert moved[1] != img[1]
    spanning = key_extra(4, mm=[("red", 3, 6)])  # tokens 3..8: chunks 0, 1 and 2
    assert [c for c, _ in spanning.chunks] == [0, 1, 2]


def test_extra_material_cannot_pose_as_tokens():
    """Material enters the chain through its own personalised hash, never as token bytes."""
    chunk_material = key_extra(4, chunk_material={2: [["x", 1]]})
    assert keys(chunk_material)[:2] == keys()[:2] and keys(chunk_material)[2] != keys()[2]
    assert keys(chunk_material) != keys(tokens=TOKENS + [1])


def test_keys_are_the_same_in_another_process_with_another_hash_seed():
    code = ("from kvctl.connector.ownership import chunk_keys, key_extra; "
            "print(chunk_keys(list(range(10)), 4, 'm', 'f', key_extra(4, cache_salt='s', lora=('a', '/p'), "
            "mm=[('img', 5, 2)], chunk_material={0: [['prompt_embeds', 'ab']]})))")
    outs = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        outs.add(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60,
                                check=True).stdout)
    assert len(outs) == 1
    assert outs.pop().strip() == str(keys(key_extra(4, cache_salt="s", lora=("a", "/p"), mm=[("img", 5, 2)],
                                                    chunk_material={0: [["prompt_embeds", "ab"]]})))
