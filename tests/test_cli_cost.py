"""CliRunner tests for `kvctl cost`: the invocations from the issue, as written."""

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl import __version__
from kvctl.cli import cli

MODELS = Path(__file__).resolve().parent.parent / "configs" / "models"


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
    d = run_json("cost fit-t0 --latency-s 0.40 --prompt-gb 0.79 --bandwidth-gbps 10.76 --json".split())
    assert d["t0_s"] == pytest.approx(0.3266, abs=1e-4)


def test_predict_json():
    d = run_json(
        "cost predict --bytes-per-token 48437.5 --prefill-rate 52200 --t0 0.3266 --bandwidth-gbps 1.71 "
        "--tokens 4096 16384 65536 --json".split()
    )
    preds = {p["tokens"]: p for p in d["predictions"]}
    assert sorted(preds) == [4096, 16384, 65536]
    assert preds[16384]["load_s"] == pytest.approx(0.79, abs=0.005)
    assert {p["verdict"] for p in preds.values()} == {"recompute"}
    assert set(preds[4096]) >= {"tokens", "recompute_s", "load_s", "verdict"}


def test_rho_json_and_token_form():
    d = run_json("cost rho --arrival-rate 1.21 --prompt-gb 0.79 --bandwidth-gbps 0.85 --json".split())
    assert d["rho"] == pytest.approx(1.12, abs=0.01) and d["stable"] is False
    assert d["instances_for_target"] == 3
    d2 = run_json("cost rho --arrival-rate 1.21 --tokens 16310 --bytes-per-token 48437.5 --bandwidth-gbps 0.85 --json".split())
    assert d2["rho"] == pytest.approx(d["rho"], rel=1e-3)
    text = run("cost rho --arrival-rate 1.21 --prompt-gb 0.79 --bandwidth-gbps 0.85".split()).output
    assert "instances for ρ ≤ 0.5" in text


def test_kv_size_json():
    d = run_json(["cost", "kv-size", "--config", str(MODELS / "deepseek-v3.json"), "--dtype", "fp8", "--json"])
    assert d["attention"] == "mla" and d["bytes_per_token"] == 35136 and d["chunk_bytes"] == 35136 * 256
    d = run_json(["cost", "kv-size", "--config", str(MODELS / "llama-3.1-8b.json"), "--tp", "2", "--chunk-tokens", "128", "--json"])
    assert d["attention"] == "gqa" and d["chunk_bytes"] == 65536 * 128


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
        ("cost rho --arrival-rate 0 --prompt-gb 0.79 --bandwidth-gbps 0.85", "--arrival-rate"),
        ("cost rho --arrival-rate 1 --bandwidth-gbps 0.85", "--prompt-gb"),
        ("cost kv-size --config /nonexistent/config.json", "cannot read model config"),
        ("cost kv-size --config {models}/deepseek-v3.json --dtype int4", "--dtype"),
        ("cost predict --bytes-per-token 1 --prefill-rate 1 --t0 0 --bandwidth-gbps 1 --tokens 0", "--tokens"),
        ("cost report --model-config {models}/deepseek-v3.json", "--prefill-rate is required"),
        ("cost fit-t0 --latency-s 0.01 --prompt-gb 0.79 --bandwidth-gbps 1", "below the pure transfer time"),
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
    result = CliRunner().invoke(cli, ["cost", "kv-size", "--config", str(p)])
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
