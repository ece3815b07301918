"""Hostile model configs (issue 44, items 4, 14 and 16): every ``--model-config`` is read in one place
(``kvctl.core.kvsize.load_config``: ``kvctl.core.files.read_json``, a regular file, a size cap, the depth bound,
UTF-8) and every field the KV size uses is typed and bounded before any arithmetic (``kvctl/core/thresholds.py``
``MODEL_*``). A bad one is one line naming the key and the file, exit 2, for every command that takes
``--model-config``; a real config still gives today's numbers.

Real files throughout; the hang cases run a real kvctl process under a deadline and an address-space cap.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core.kvsize import kv_size_from_file
from tests.hostile.helpers import kvctl, limits

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "configs" / "models"
GLM = json.loads((MODELS / "glm-5.json").read_text())  # MLA with a sparse-attention indexer
LLAMA = json.loads((MODELS / "llama-3.1-8b.json").read_text())  # GQA
DSV3 = json.loads((MODELS / "deepseek-v3.json").read_text())  # MLA


def _json(base: dict, **fields) -> str:
    return json.dumps({**base, **fields})


def _raw(base: dict, key: str, literal: str) -> str:
    """``base`` with ``key`` set to a JSON literal json.dumps cannot write (1e400, NaN, a 400-digit integer)."""
    rest = {k: v for k, v in base.items() if k != key}
    return json.dumps(rest)[:-1] + f', "{key}": {literal}}}'


#: (id, the file's text or bytes, what the one-line message names)
HOSTILE = [
    # item 14: crashes
    ("deep-200k", "[" * 200_000 + "]" * 200_000, "nested too deeply"),
    ("non-utf8", b'{"num_hidden_layers": 4, "_name_or_path": "\xff\xfe"}', "not UTF-8"),
    ("freq-1e400", _raw(GLM, "index_topk_freq", "1e400"), "index_topk_freq"),
    ("layers-10**400", _raw(GLM, "num_hidden_layers", "1" + "0" * 400), "num_hidden_layers"),
    ("freq-abc", _json(GLM, index_topk_freq="abc"), "index_topk_freq"),
    ("freq-list", _json(GLM, index_topk_freq=[1]), "index_topk_freq"),
    ("freq-zero", _json(GLM, index_topk_freq=0), "index_topk_freq"),
    ("freq-true", _json(GLM, index_topk_freq=True), "index_topk_freq"),
    ("pattern-int", _json(GLM, index_topk_pattern=5), "index_topk_pattern"),
    ("pattern-dict", _json(GLM, index_topk_pattern={"a": 1}), "index_topk_pattern"),
    ("pattern-list-of-ints", _json(GLM, index_topk_pattern=["S", 5]), "index_topk_pattern"),
    ("pattern-too-long", _json(GLM, index_topk_pattern="S" * 20_000), "index_topk_pattern"),
    ("offset-str", _json(GLM, index_skip_topk_offset="2"), "index_skip_topk_offset"),
    ("offset-negative", _json(GLM, index_skip_topk_offset=-1), "index_skip_topk_offset"),
    # item 16: wrong numbers from head_dim, and its siblings
    ("head_dim-negative", _json(LLAMA, head_dim=-128), "head_dim"),
    ("head_dim-string", _json(LLAMA, head_dim="128"), "head_dim"),
    ("head_dim-zero", _json(LLAMA, head_dim=0), "head_dim"),
    ("head_dim-fraction", _json(LLAMA, head_dim=1.5), "head_dim"),
    ("head_dim-1e30", _json(LLAMA, head_dim=1e30), "head_dim"),
    ("head_dim-true", _json(LLAMA, head_dim=True), "head_dim"),
    ("head_dim-nan", _raw(LLAMA, "head_dim", "NaN"), "head_dim"),
    ("hidden_size-string", _json({k: v for k, v in LLAMA.items() if k != "head_dim"}, hidden_size="4096"), "hidden_size"),
    ("hidden_size-below-heads", _json({k: v for k, v in LLAMA.items() if k != "head_dim"}, hidden_size=16), "hidden_size"),
    ("heads-1e400", _raw(LLAMA, "num_attention_heads", "1e400"), "num_attention_heads"),
    ("heads-huge", _json(LLAMA, num_attention_heads=2**40, num_key_value_heads=8), "num_attention_heads"),
    ("kv_heads-string", _json(LLAMA, num_key_value_heads="8"), "num_key_value_heads"),
    ("kv_heads-fraction", _json(LLAMA, num_key_value_heads=2.5), "num_key_value_heads"),
    ("layers-zero", _json(LLAMA, num_hidden_layers=0), "num_hidden_layers"),
    ("layers-float-2e9", _json(LLAMA, num_hidden_layers=2e9), "num_hidden_layers"),
    ("kv_lora_rank-string", _json(DSV3, kv_lora_rank="512"), "kv_lora_rank"),
    ("kv_lora_rank-negative", _json(DSV3, kv_lora_rank=-512), "kv_lora_rank"),
    ("rope-1e30", _json(DSV3, qk_rope_head_dim=1e30), "qk_rope_head_dim"),
    ("index_head_dim-huge", _json(GLM, index_head_dim=128 * 10**9), "index_head_dim"),
    ("index_topk-string", _json(GLM, index_topk="2048"), "index_topk"),
    ("torch_dtype-list", _json(LLAMA, torch_dtype=["bfloat16"]), "torch_dtype"),
    ("model_type-dict", _json(LLAMA, model_type={"a": 1}), "model_type"),
    ("name-not-a-string", _json(LLAMA, _name_or_path=5), "_name_or_path"),
    ("name-with-newline", _json(LLAMA, _name_or_path="a\nError: forged"), "_name_or_path"),
    ("not-an-object", "[1, 2]", "JSON object"),
    ("text_config-not-object", json.dumps({"text_config": 5}), "num_hidden_layers"),
    # each field in range, the product past what any model has (and past --bytes-per-token's own cap)
    ("bytes-per-token-past-cap", _json(LLAMA, num_hidden_layers=10_000, num_attention_heads=1024, num_key_value_heads=1024,
                                       head_dim=4096), "bytes per token"),
]


def _write(tmp_path: Path, content: str | bytes) -> Path:
    p = tmp_path / "config.json"
    if isinstance(content, bytes):
        p.write_bytes(content)
    else:
        p.write_text(content)
    return p


def _one_line_refusal(code: int, output: str, path: Path, says: str) -> None:
    assert code == 2, (code, output[-800:])
    assert "unexpected" not in output and "Traceback" not in output, output[-800:]
    lines = [x for x in output.strip().splitlines() if x.strip()]
    assert len(lines) == 1, output
    assert says in lines[0] and str(path) in lines[0], lines[0]


@pytest.mark.parametrize("content,says", [pytest.param(c, s, id=i) for i, c, s in HOSTILE])
def test_a_hostile_model_config_is_one_line_naming_the_key(tmp_path, content, says):
    path = _write(tmp_path, content)
    r = CliRunner().invoke(cli, ["cost", "kv-size", "--model-config", str(path)])
    _one_line_refusal(r.exit_code, r.output, path, says)


def test_two_billion_layers_return_at_once_not_after_walking_them(tmp_path):
    """Item 4: ``indexer_layers()`` walked every layer of ``num_hidden_layers`` (2e9 never returned)."""
    path = _write(tmp_path, _json(GLM, num_hidden_layers=2_000_000_000))
    res = kvctl(["cost", "kv-size", "--model-config", str(path)], tmp_path / "home", timeout_s=30, preexec=limits(as_bytes=2 << 30))
    assert res.returncode == 2, (res.returncode, res.output[-800:])  # None: still walking at the deadline
    assert "num_hidden_layers" in res.stderr and str(path) in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_fifo_or_a_device_as_model_config_is_refused_not_read(tmp_path):
    fifo = tmp_path / "config.fifo"
    os.mkfifo(fifo)
    for path in (fifo, Path("/dev/zero")):
        res = kvctl(["cost", "kv-size", "--model-config", str(path)], tmp_path / "home", timeout_s=30, preexec=limits(as_bytes=2 << 30))
        assert res.returncode == 2 and "not a regular file" in res.stderr, (res.returncode, res.output[-800:])


def test_a_model_config_past_the_size_cap_is_refused(tmp_path):
    from kvctl.core.thresholds import MODEL_CONFIG_MAX_BYTES

    path = _write(tmp_path, json.dumps({**LLAMA, "padding": "x" * MODEL_CONFIG_MAX_BYTES}))
    r = CliRunner().invoke(cli, ["cost", "kv-size", "--model-config", str(path)])
    _one_line_refusal(r.exit_code, r.output, path, "cap")


#: every command that takes --model-config, with what else it needs to get as far as reading it
CONSUMERS = {
    "cost kv-size": ["cost", "kv-size"],
    "cost report": ["cost", "report", "--prefill-rate", "52200"],
    "cost breakeven": ["cost", "breakeven", "--prefill-rate", "52200"],
    "cost rho": ["cost", "rho", "--arrival-rate", "1", "--prompt-tokens", "1000", "--instance-gbps", "1"],
    "simulate": ["simulate", "--arrival-rate", "1", "--prompt-tokens", "1000", "--prefill-rate", "52200", "--instance-gbps", "1",
                 "--requests", "10"],
    "plan": ["plan", "--arrival-rate", "1", "--prompt-tokens", "1000", "--prefill-rate", "52200", "--instance-gbps", "1",
             "--slo-p99", "5", "--requests", "10", "--max-instances", "2"],
    "diagnose": ["diagnose", "--engine-url", "http://127.0.0.1:1", "--window", "1", "--timeout", "1"],
    "bench": ["bench", "--valkey", "resp://127.0.0.1:1", "--duration", "1", "--timeout", "1"],
}


@pytest.mark.parametrize("consumer", sorted(CONSUMERS))
@pytest.mark.parametrize("content,says", [pytest.param(_json(LLAMA, head_dim=-128), "head_dim", id="head_dim"),
                                          pytest.param(_json(GLM, index_topk_pattern=5), "index_topk_pattern", id="pattern"),
                                          pytest.param("[" * 200_000 + "]" * 200_000, "nested too deeply", id="deep")])
def test_every_consumer_of_model_config_gives_the_same_error(tmp_path, consumer, content, says):
    """Not `--bytes-per-token` (which the user never gave), not a traceback: the key and the file, exit 2."""
    path = _write(tmp_path, content)
    r = CliRunner().invoke(cli, [*CONSUMERS[consumer], "--model-config", str(path)])
    _one_line_refusal(r.exit_code, r.output, path, says)
    assert "--bytes-per-token" not in r.output


# ----------------------------------------------------------------------------- real configs keep their numbers

#: (file, --dtype, --tp) -> (attention, layers, bytes_per_token, bytes_per_token_per_rank, chunk_bytes, indexer_layers),
#: as kvctl computed them before issue 44
TODAY = {
    ("deepseek-v2-lite-shape.json", None, 1): ("mla", 27, 31104.0, 31104.0, 7962624.0, 0),
    ("deepseek-v2-lite-shape.json", "fp8", 8): ("mla", 27, 15552.0, 1944.0, 3981312.0, 0),
    ("deepseek-v3.json", None, 1): ("mla", 61, 70272.0, 70272.0, 17989632.0, 0),
    ("deepseek-v3.json", "fp8", 8): ("mla", 61, 35136.0, 4392.0, 8994816.0, 0),
    ("glm-5-shrunk-shape.json", None, 1): ("mla+indexer", 4, 5136.0, 5136.0, 1314816.0, 4),
    ("glm-5-shrunk-shape.json", "fp8", 8): ("mla+indexer", 4, 3152.0, 394.0, 806912.0, 4),
    ("glm-5.json", None, 1): ("mla+indexer", 78, 100152.0, 100152.0, 25638912.0, 78),
    ("glm-5.json", "fp8", 8): ("mla+indexer", 78, 61464.0, 7683.0, 15734784.0, 78),
    ("llama-2-7b.json", None, 1): ("mha", 32, 524288.0, 524288.0, 134217728.0, 0),
    ("llama-2-7b.json", "fp8", 8): ("mha", 32, 262144.0, 32768.0, 8388608.0, 0),
    ("llama-3.1-8b.json", None, 1): ("gqa", 32, 131072.0, 131072.0, 33554432.0, 0),
    ("llama-3.1-8b.json", "fp8", 8): ("gqa", 32, 65536.0, 8192.0, 2097152.0, 0),
    ("qwen3-32b.json", None, 1): ("gqa", 64, 262144.0, 262144.0, 67108864.0, 0),
    ("qwen3-32b.json", "fp8", 8): ("gqa", 64, 131072.0, 16384.0, 4194304.0, 0),
}


def test_every_real_config_is_covered():
    assert {f for f, _, _ in TODAY} == {p.name for p in MODELS.glob("*.json")}


@pytest.mark.parametrize("name,dtype,tp", sorted(TODAY, key=str))
def test_a_real_config_still_gives_todays_numbers(name, dtype, tp):
    k = kv_size_from_file(MODELS / name, dtype=dtype, tp=tp)
    assert (k.attention, k.layers, k.bytes_per_token, k.bytes_per_token_per_rank, k.chunk_bytes, k.indexer_layers) == TODAY[(name, dtype, tp)]


#: GLM-5 (78 layers, fp8) with vLLM's top-k rules: indexer layers and s as computed before issue 44
SPARSE_TODAY = [
    ({"index_topk_freq": 2}, 40, 56448.0),
    ({"index_topk_freq": 3, "index_skip_topk_offset": 0}, 26, 54600.0),
    ({"index_topk_pattern": "SF" * 39}, 39, 56316.0),
    ({"index_topk_pattern": ["S", "F", "F"]}, 77, 61332.0),
    ({"index_topk_freq": 4, "index_skip_topk_offset": 7}, 24, 54336.0),
    ({"index_topk_freq": None, "index_topk_pattern": None}, 78, 61464.0),  # null: vLLM's defaults
    ({"num_hidden_layers": 78.0, "head_dim": None}, 78, 61464.0),  # an integral float is that integer
]


@pytest.mark.parametrize("extra,layers,bpt", SPARSE_TODAY)
def test_sparse_indexer_rules_keep_their_numbers(tmp_path, extra, layers, bpt):
    path = _write(tmp_path, json.dumps({**GLM, **extra}))
    k = kv_size_from_file(path, dtype="fp8")
    assert (k.indexer_layers, k.bytes_per_token) == (layers, bpt)


def test_the_largest_layer_count_allowed_is_quick(tmp_path):
    """At the cap (MODEL_MAX_LAYERS) the indexer's layers are still counted, in well under a second."""
    from kvctl.core.thresholds import MODEL_MAX_LAYERS

    path = _write(tmp_path, json.dumps({**GLM, "num_hidden_layers": MODEL_MAX_LAYERS, "index_topk_freq": 3}))
    k = kv_size_from_file(path, dtype="fp8")
    assert k.layers == MODEL_MAX_LAYERS and 0 < k.indexer_layers < MODEL_MAX_LAYERS
