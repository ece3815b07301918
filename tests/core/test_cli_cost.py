"""CliRunner tests for `kvctl cost`: the invocations from the issue, as written."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl import __version__
from kvctl.cli import cli

MODELS = Path(__file__).resolve().parents[2] / "configs" / "models"


def run(args, code=0):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == code, result.output
    return result


def run_json(args):
    return json.loads(run(args).stdout)


def test_version():
    assert __version__ in run(["--version"]).output


def test_breakeven_json():
    d = run_json("cost breakeven --bytes-per-token 48437.5 --prefill-rate 52200 --t0 0.33 --json".split())
    assert d["breakeven_gbps"] == pytest.approx(2.528, abs=1e-3)
    assert d["min_hit_tokens"] == pytest.approx(17226)
    d = run_json("cost breakeven --bytes-per-token 48437.5 --prefill-rate 52200 --json".split())
    assert "min_hit_tokens" not in d


def test_fit_t0_json():
    d = run_json("cost fit-t0 --latency-s 0.40 --prompt-gb 0.79 --tier-gbps 10.76 --json".split())
    assert d["t0_s"] == pytest.approx(0.3266, abs=1e-4)


def test_predict_json():
    d = run_json(
        "cost predict --bytes-per-token 48437.5 --prefill-rate 52200 --t0 0.3266 --tier-gbps 1.71 "
        "--prompt-tokens 4096 16384 65536 --json".split()
    )
    preds = {p["tokens"]: p for p in d["predictions"]}
    assert sorted(preds) == [4096, 16384, 65536]
    assert preds[16384]["load_s"] == pytest.approx(0.79, abs=0.005)
    assert {p["verdict"] for p in preds.values()} == {"recompute"}
    assert set(preds[4096]) >= {"tokens", "recompute_s", "load_s", "verdict"}


def test_rho_json_and_token_form():
    d = run_json("cost rho --arrival-rate 1.21 --prompt-gb 0.79 --instance-gbps 0.85 --json".split())
    assert d["rho"] == pytest.approx(1.12, abs=0.01) and d["stable"] is False
    assert d["instances_for_rho_target"] == 3
    d2 = run_json("cost rho --arrival-rate 1.21 --prompt-tokens 16310 --bytes-per-token 48437.5 --instance-gbps 0.85 --json".split())
    assert d2["rho"] == pytest.approx(d["rho"], rel=1e-3)
    text = run("cost rho --arrival-rate 1.21 --prompt-gb 0.79 --instance-gbps 0.85".split()).output
    assert "instances for ρ ≤ 0.5" in text


def test_kv_size_json():
    d = run_json(["cost", "kv-size", "--model-config", str(MODELS / "deepseek-v3.json"), "--dtype", "fp8", "--json"])
    assert d["attention"] == "mla" and d["bytes_per_token"] == 35136 and d["chunk_bytes"] == 35136 * 256
    d = run_json(["cost", "kv-size", "--model-config", str(MODELS / "llama-3.1-8b.json"), "--tp", "2", "--chunk-tokens", "128", "--json"])
    assert d["attention"] == "gqa" and d["chunk_bytes"] == 65536 * 128


def test_kv_size_counts_the_sparse_attention_indexer():
    """Issue 34: GLM-5 (MLA with a sparse-attention indexer) moves the latent rows and the indexer's keys."""
    d = run_json(["cost", "kv-size", "--model-config", str(MODELS / "glm-5.json"), "--dtype", "fp8", "--json"])
    assert d["attention"] == "mla+indexer" and d["bytes_per_token"] == 61464 and d["chunk_bytes"] == 61464 * 256
    assert (d["latent_row_bytes"], d["indexer_layers"], d["indexer_row_bytes"], d["indexer_bytes_per_token"]) == (
        656, 78, 132, 10296)
    out = run(["cost", "kv-size", "--model-config", str(MODELS / "glm-5.json"), "--dtype", "fp8"]).output
    assert "indexer keys (78 layers x 132 B)" in out and "fp8_ds_mla" in out and "two stored values" in out
    d = run_json(["cost", "breakeven", "--model-config", str(MODELS / "glm-5.json"), "--dtype", "fp8", "--prefill-rate",
                  "52200", "--json"])
    assert d["breakeven_gbps"] == pytest.approx(61464 * 52200 / 1e9)  # B* from the true s


def test_model_config_replaces_bytes_per_token():
    d = run_json(["cost", "breakeven", "--model-config", str(MODELS / "deepseek-v3.json"), "--dtype", "fp8", "--prefill-rate", "1e5", "--json"])
    assert d["breakeven_gbps"] == pytest.approx(35136 * 1e5 / 1e9)


def test_report_default_is_the_paper():
    d = run_json(["cost", "report", "--json"])
    (p,) = d["pairings"]
    assert p["breakeven_gbps"] == pytest.approx(2.528, abs=1e-3)
    assert [b["bandwidth_gbps"] for b in p["bandwidths"]] == [0.85, 1.71, 10.76]
    out = run(["cost", "report"]).output
    assert "B* = s·R = 2.528 GB/s" in out and "GLM-5.3" in out


def test_report_with_model():
    out = run(["cost", "report", "--model-config", str(MODELS / "llama-3.1-8b.json"), "--prefill-rate", "20000"]).output
    assert "gqa" in out


@pytest.mark.parametrize(
    "args,needle",
    [
        ("cost breakeven --bytes-per-token 0 --prefill-rate 52200", "--bytes-per-token"),
        ("cost breakeven --bytes-per-token 48437.5 --prefill-rate -5", "--prefill-rate"),
        ("cost breakeven --prefill-rate 5", "--bytes-per-token or --model-config"),
        ("cost rho --arrival-rate 0 --prompt-gb 0.79 --instance-gbps 0.85", "--arrival-rate"),
        ("cost rho --arrival-rate 1 --instance-gbps 0.85", "--prompt-gb"),
        ("cost kv-size --model-config /nonexistent/config.json", "cannot read model config"),
        ("cost kv-size --model-config {models}/deepseek-v3.json --dtype int4", "--dtype"),
        ("cost predict --bytes-per-token 1 --prefill-rate 1 --t0 0 --tier-gbps 1 --prompt-tokens 0", "--prompt-tokens"),
        ("cost report --model-config {models}/deepseek-v3.json", "--prefill-rate is required"),
        ("cost fit-t0 --latency-s 0.01 --prompt-gb 0.79 --tier-gbps 1", "below the pure transfer time"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle):
    result = CliRunner().invoke(cli, args.format(models=MODELS).split())
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_missing_config_field_exits_2(tmp_path):
    p = tmp_path / "config.json"
    p.write_text(json.dumps({"num_hidden_layers": 4, "kv_lora_rank": 512}))
    result = CliRunner().invoke(cli, ["cost", "kv-size", "--model-config", str(p)])
    assert result.exit_code == 2 and "qk_rope_head_dim" in result.output


def test_help_is_fast_and_does_not_import_torch():
    import subprocess
    import sys

    code = "import sys; from kvctl.cli import cli; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "ok", out.stderr


def test_help_does_not_load_the_tier_or_bench_machinery():
    """psutil (tier.local), yaml (lmcache_config), multiprocessing + RESP client (bench) load when a command runs."""
    import subprocess
    import sys

    heavy = ["kvctl.tier.local", "kvctl.tier.lmcache_config", "kvctl.bench.runner", "kvctl.bench.worker", "kvctl.connector.resp"]
    code = f"import sys; from kvctl.cli import cli; print([m for m in {heavy!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# --------------------------------------------------------------- --tp: whole model vs one rank (issue 13)
# Llama-3.1-8B (configs/models/llama-3.1-8b.json): 32 layers, 8 KV heads, head_dim 4096 / 32 = 128, bf16.
#   whole model  s   = 2 (K, V) × 32 × 8 × 128 × 2 B = 131072 B/token
#   one rank, tp 8   = 2 × 32 × 1 × 128 × 2 B       =  16384 B/token (one KV head each)
# R = 100k tok/s: recomputing costs 1 / 1e5 s = 10 µs per token.
# Tier: 8 instances (one per rank) × 1 GB/s = 8 GB/s; a prompt moves 131072 B per token through it:
#   131072 / 8e9 s = 16.384 µs per token (equivalently 16384 B / 1e9 B/s per rank in parallel) > 10 µs:
#   recompute wins. Comparing the per-rank 16384 B with the whole tier's 8 GB/s (2.048 µs) was the bug.
LLAMA = str(MODELS / "llama-3.1-8b.json")


def test_kv_size_tp8_gives_whole_model_and_per_rank_bytes():
    d = run_json(["cost", "kv-size", "--model-config", LLAMA, "--tp", "8", "--json"])
    assert d["bytes_per_token"] == 131072
    assert d["bytes_per_token_per_rank"] == 16384
    assert d["tp"] == 8
    assert d["chunk_bytes"] == 16384 * 256  # one rank's stored chunk value: 4194304 B
    out = run(["cost", "kv-size", "--model-config", LLAMA, "--tp", "8"]).output
    assert "131,072" in out and "16,384" in out and "per rank" in out


def test_breakeven_tp8_is_the_whole_tiers_bandwidth():
    d = run_json(["cost", "breakeven", "--model-config", LLAMA, "--tp", "8", "--prefill-rate", "100000", "--json"])
    assert d["bytes_per_token"] == 131072 and d["bytes_per_token_per_rank"] == 16384 and d["tp"] == 8
    assert d["breakeven_gbps"] == pytest.approx(13.1072)  # 131072 B × 1e5 tok/s = 13.1072e9 B/s, the whole tier
    assert d["breakeven_gbps_per_rank"] == pytest.approx(1.6384)  # 16384 B × 1e5 tok/s: each of the 8 instances
    out = run(["cost", "breakeven", "--model-config", LLAMA, "--tp", "8", "--prefill-rate", "100000"]).output
    assert "13.107" in out and "1.638" in out


def test_breakeven_bytes_per_token_is_whole_model_with_tp():
    # --bytes-per-token keeps meaning the whole model; --tp 8 only adds the per-rank share 131072 / 8 = 16384
    d = run_json("cost breakeven --bytes-per-token 131072 --tp 8 --prefill-rate 100000 --json".split())
    assert d["breakeven_gbps"] == pytest.approx(13.1072) and d["bytes_per_token_per_rank"] == 16384
    d1 = run_json("cost breakeven --bytes-per-token 131072 --prefill-rate 100000 --json".split())
    assert d1["bytes_per_token_per_rank"] == 131072 and d1["tp"] == 1


def test_predict_tp8_at_8_gbps_says_recompute():
    d = run_json(["cost", "predict", "--model-config", LLAMA, "--tp", "8", "--prefill-rate", "100000", "--t0", "0",
                  "--tier-gbps", "8", "--prompt-tokens", "1000", "--json"])
    (p,) = d["predictions"]
    assert p["recompute_s"] == pytest.approx(0.01)  # 1000 / 1e5
    assert p["load_s"] == pytest.approx(0.016384)  # 1000 × 131072 / 8e9
    assert p["verdict"] == "recompute"
    assert d["bytes_per_token"] == 131072 and d["bytes_per_token_per_rank"] == 16384


def test_report_tp8_at_8_gbps_never_loads():
    d = run_json(["cost", "report", "--model-config", LLAMA, "--tp", "8", "--prefill-rate", "100000", "--t0", "0",
                  "--tier-gbps", "8", "--tier-gbps", "16", "--prompt-tokens", "1000", "--json"])
    (p,) = d["pairings"]
    assert p["bytes_per_token"] == 131072 and p["bytes_per_token_per_rank"] == 16384
    at8, at16 = p["bandwidths"]
    assert at8["crossover_tokens"] is None and at8["predictions"][0]["verdict"] == "recompute"
    # 16 GB/s: 131072 / 16e9 = 8.192 µs < 10 µs per token: loading wins
    assert at16["predictions"][0]["verdict"] == "load"


def test_rho_tp8_single_instance_and_one_instance_per_rank():
    # 16384 tokens × 131072 B = 2147483648 B = 2.147483648 GB per prompt; λ = 2/s; one instance of 1 GB/s:
    #   ρ = 2 × 2.147483648 / 1 = 4.294967296; for ρ ≤ 0.5: ceil(4.294967296 / 0.5) = ceil(8.59) = 9 instances.
    # One instance per rank (8): each moves 16384 × 16384 B = 0.268435456 GB per prompt: ρ = 2 × 0.268435456 = 0.536870912
    d = run_json(["cost", "rho", "--arrival-rate", "2", "--prompt-tokens", "16384", "--model-config", LLAMA, "--tp", "8",
                  "--instance-gbps", "1", "--json"])
    assert d["prompt_gb"] == pytest.approx(2.147483648)
    assert d["rho"] == pytest.approx(4.294967296)
    assert d["instances_for_rho_target"] == 9
    assert d["bytes_per_token"] == 131072 and d["bytes_per_token_per_rank"] == 16384 and d["tp"] == 8
    assert d["rho_one_instance_per_rank"] == pytest.approx(0.536870912)


def test_report_takes_tokens_as_predict_does_and_predict_defaults_t0():
    """Issue 22: `cost report --prompt-tokens 4096 8192` failed where `cost predict` takes it, and `cost predict`
    required --t0 while every other command defaults it to the paper's."""
    from kvctl.core.thresholds import PAPER_T0_S

    rep = run_json(["cost", "report", "--prompt-tokens", "4096", "8192", "--json"])
    assert [p["tokens"] for p in rep["pairings"][0]["bandwidths"][0]["predictions"]] == [4096, 8192]
    pred = run_json(["cost", "predict", "--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--tier-gbps", "10.76",
                     "--prompt-tokens", "16384", "--json"])
    (p,) = pred["predictions"]
    assert p["load_s"] == pytest.approx(PAPER_T0_S + 16384 * 48437.5 / 10.76e9)
