"""Shard mode's keys are LMCache 0.5.6's own keys, renamed to worker 0: no weaker than stock LMCache.

Runs LMCache's own token database and multimodal substitution (the scenario
``shard_key_coverage``) in the LMCache interpreter. What it pins (docs/connector.md, "The LMCache
path"): stock LMCache covers images (placeholder tokens replaced from the image hash) and
``lmcache.tag.*`` request configs, and so does shard mode; neither covers ``cache_salt`` or the LoRA
adapter (LMCache's token database takes no such input), so on this path tenants are separated with a
tag or a tier of their own.
"""

from __future__ import annotations

import pytest

from tests.lmcache.lmcache_env import run_scenario

pytestmark = pytest.mark.engine


@pytest.fixture(scope="module")
def keys(lmc_python):  # noqa: F811
    return run_scenario("shard_key_coverage", {}, python=lmc_python)


def _hash_and_tags(key: str) -> str:
    """``model@world@worker@hash@dtype[@tags]`` without the worker id."""
    parts = key.split("@")
    return "@".join(parts[:2] + parts[3:])


@pytest.mark.parametrize("case", ["plain", "red", "blue", "tag_a", "tag_b"])
def test_shard_keys_are_the_stock_keys_under_worker_0(keys, case):
    stock, shard = keys[f"stock_{case}"], keys[f"shard_{case}"]
    assert len(stock) == len(shard) == 4
    assert [k.split("@")[2] for k in shard] == ["0"] * 4 and [k.split("@")[2] for k in stock] == ["1"] * 4
    assert [_hash_and_tags(k) for k in shard] == [_hash_and_tags(k) for k in stock]


@pytest.mark.parametrize("db", ["stock", "shard"])
def test_an_image_and_a_tag_change_the_keys_in_both(keys, db):
    plain, red, blue = keys[f"{db}_plain"], keys[f"{db}_red"], keys[f"{db}_blue"]
    # the image sits in chunk 1: chunk 0 is shared, every chunk from 1 on differs
    assert red[0] == blue[0] == plain[0]
    assert all(r != b and r != p for r, b, p in zip(red[1:], blue[1:], plain[1:], strict=True))
    a, b = keys[f"{db}_tag_a"], keys[f"{db}_tag_b"]
    assert all(x != y and x != p for x, y, p in zip(a, b, plain, strict=True))


def test_lmcache_token_database_has_no_salt_or_lora_input(keys):
    """The gap both modes share (docs/connector.md): nothing but tokens, hashes, offsets, mask and tags."""
    assert keys["process_tokens_params"] == ["hashes", "make_key", "mask", "offsets", "request_configs", "tokens"]
