"""Issue 48 item 5, GPU users: which vLLM releases kvctl's connector is proven with (one list, kvctl.core.thresholds),
what `kvctl doctor` says of an engine's release, install lines that work from a checkout, docs/gpu.md's "What is proven"
table built from the committed result files (benchmarks/results/), a launch line for LMCache's own connector on a GPU,
and the README's wiring example with the `--shutdown-timeout` that saves need."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.core import thresholds
from tests.engine_stub import REAL_METRICS, VllmStub

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
GPU_DOC = (ROOT / "docs" / "gpu.md").read_text()
README = (ROOT / "README.md").read_text()


# --- doctor: the engine's vLLM release against the releases proven ---------------------------------------------------


@pytest.fixture(autouse=True)
def _no_lmcache_venv(monkeypatch):
    monkeypatch.delenv("KVCTL_LMCACHE_PYTHON", raising=False)  # doctor would check LMCache too (tests/ops/test_doctor.py)


def doctor(args: list[str]) -> dict:
    res = CliRunner().invoke(cli, ["doctor", "--json", *args])
    data = json.loads(res.stdout)
    assert res.exit_code == data["exit_code"], res.output
    return data


@pytest.mark.parametrize("version, status, says", [
    ("0.32.0", "ok", "proven"),
    ("0.32.0+cu130", "ok", "proven"),  # a local build of a proven release
    ("0.33.0", "ok", "proven"),  # its GPU engine tests on an H100, 2026-12-07
    ("0.31.2", "warning", "untested"),
    ("0.32.1rc1", "warning", "untested"),
])
def test_doctor_says_how_far_the_engines_vllm_release_is_proven(version, status, says):
    with VllmStub(REAL_METRICS + "kvctl:ranks 1\n", version=version) as eng:
        d = doctor(["--engine-url", eng.url, "--no-host-checks"])
    line = next(c for c in d["checks"] if c["name"] == "vllm_version")
    assert line["status"] == status and line["message"].startswith(f"vLLM {version}") and says in line["message"], line
    assert line["evidence"]["proven"] == list(thresholds.VLLM_PROVEN)
    if status == "warning":  # the fix names the releases that are proven, and where the table is
        assert all(v in line["fix"] for v in thresholds.VLLM_PROVEN) and "docs/gpu.md" in line["fix"], line


def test_doctor_warns_of_a_release_whose_api_alone_is_checked(monkeypatch):
    """A release checked on CPU (its connector API, its scheduler) that no GPU engine ran yet: a warning that says so."""
    from kvctl.ops import doctor_host
    monkeypatch.setattr(doctor_host, "VLLM_API_CHECKED", ("0.34.0",))
    with VllmStub(REAL_METRICS + "kvctl:ranks 1\n", version="0.34.0") as eng:
        d = doctor(["--engine-url", eng.url, "--no-host-checks"])
    line = next(c for c in d["checks"] if c["name"] == "vllm_version")
    assert line["status"] == "warning" and "not run in a GPU engine yet" in line["message"], line
    assert line["evidence"]["api_checked"] == ["0.34.0"]


def _versions_in(obj) -> set[str]:
    """Every vLLM version a result file records (``versions.vllm``, ``vllm``, ``meta.vllm``; "0.32.0 (cu13)" is 0.32.0)."""
    found: set[str] = set()
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "vllm" and isinstance(v, str):
                found.add(v.split()[0])
            else:
                found |= _versions_in(v)
    elif isinstance(obj, list):
        for v in obj[:50]:
            found |= _versions_in(v)
    return found


def test_the_releases_proven_are_those_of_the_committed_gpu_results_and_api_manifests():
    ran = set().union(*(_versions_in(json.loads(p.read_text())) for p in RESULTS.rglob("*.json")))
    assert ran and set(thresholds.VLLM_PROVEN) == ran, ran
    manifests = {json.loads(p.read_text())["vllm"] for p in (ROOT / "configs" / "vllm").glob("connector-api-*.json")}
    assert set(thresholds.VLLM_API_CHECKED) == manifests - ran, manifests
    assert {"0.32.0", "0.33.0"} <= ran  # 0.33.0: gpu_engine_tests-h100-2026-12-07-vllm033.json


# --- install lines ----------------------------------------------------------------------------------------------------


def _printed_files() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted(p for d in ("kvctl", "connector", "plugins", "benchmarks") for p in (ROOT / d).rglob("*.py"))]


def test_every_install_line_works_from_a_checkout():
    """kvctl is on no package index: `pip install 'kvctl[gpu]'` fails; `pip install '.[gpu]'` in a checkout works."""
    bad = [f"{p.relative_to(ROOT)}: {m.group(0)}" for p in _printed_files()
           for m in re.finditer(r"pip install[^`'\"\n]*['\"]?kvctl\[[a-z,]+\]", p.read_text())]
    assert not bad, bad
    assert "pip install '.[gpu]'" in GPU_DOC and "pip install '.[gpu]'" in README


# --- docs/gpu.md: what is proven, from the result files ---------------------------------------------------------------


def _chains(path: Path) -> dict[str, dict]:
    data = json.loads(path.read_text())
    if isinstance(data, list):
        return {c["name"]: c for c in data}
    if "chains" in data:
        return data["chains"]
    if "steps" in data:
        return {data["name"]: data}
    return {v["name"]: v for v in data.values() if isinstance(v, dict) and "steps" in v}


#: the table's connector column -> the prefix of its chains' names in tests/gpu/test_engine_gpu.py
CHAIN_PREFIX = {"KvctlConnector": "", "LMCache's LMCacheConnectorV1": "lmcache-"}


def _tokens_right(step: dict) -> bool:
    """Each hit's greedy tokens equal the cold run's or, on a near-tie, vLLM's own prefix hit's (files that record them)."""
    cold, local = step.get("tokens_equal_cold"), step.get("tokens_equal_local_hit")
    if cold is None or local is None:  # the files of 2026-12-01/02 record no local-hit comparison: their tests judged
        return True
    return all(c or lo for c, lo in zip(cold, local))


def _file_versions(data) -> set[str]:
    """The vLLM releases a result file ran: those it records, else 0.32.0 (every file before 0.33's run records none)."""
    return _versions_in(data) or {"0.32.0"}


def _proven(path: Path, backend: str, mode: str, loading: str, prefix: str = "", right: bool = True,
            version: str = "0.32.0") -> bool:
    """Whether result file ``path`` shows restart hits for ``backend`` (``FLASHMLA``, ``FLASHMLA-fp8``: the fp8 cache) in
    ``mode`` (eager/compiled) and ``loading`` (sync/async): a chain of tests/gpu/test_engine_gpu.py (named ``prefix`` +
    backend-mode: "" KvctlConnector, "lmcache-" LMCache's connector with kvctl's plugin, "lmcache-native-" its own client)
    with such a step of three hits, each of some tokens, no error and the cold run's tokens (``right`` False: with other
    tokens); or a run of benchmarks/engine_gpu.py (KvctlConnector) with hits of cached tokens and no error; and the
    file ran vLLM ``version``."""
    data = json.loads(path.read_text())
    if version not in _file_versions(data):
        return False
    if isinstance(data, dict) and "engine" in data and "runs" in data:  # benchmarks/engine_gpu.py
        if prefix or not right:
            return False
        eng = data["engine"]
        name = eng["attention_backend"] + ("-fp8" if str(eng.get("kv_cache_dtype", "")).startswith("fp8") else "")
        runs = [r for k, r in data["runs"].items() if k.endswith(f"-{loading}")]
        hits = [h for r in runs for rows in r["lengths"].values() for h in rows]
        return (name == backend and (mode == "eager") == bool(eng.get("enforce_eager")) and not data.get("errors")
                and bool(hits) and all(h.get("cached", 0) > 0 for h in hits))
    for name, c in _chains(path).items():
        if name.removeprefix("chain-") != f"{prefix}{backend}-{mode}" or c.get("error"):
            continue
        for s in c["steps"]:
            hits = s.get("hits") or []
            if (s["mode"], s["loading"]) == (mode, loading) and not s.get("error") and len(hits) == 3 and all(h[0] > 0 for h in hits) \
                    and _tokens_right(s) == right:
                return True
    return False


def proven_table() -> tuple[str, list[list[str]], dict[str, str]]:
    section = GPU_DOC.split("## What is proven", 1)[1].split("\n## ", 1)[0]
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in section.splitlines() if ln.startswith("| ")]
    files = dict(re.findall(r"^\* \[(\w)\] `(benchmarks/results/[^`]+)`", section, re.M))
    return section, rows, files


COLUMNS = [("eager", "sync"), ("eager", "async"), ("compiled", "sync"), ("compiled", "async")]


def test_the_what_is_proven_table_heads_the_gpu_doc_and_is_built_from_the_result_files():
    """Every cell "proven" cites result files that show it; every cell "not run" is one no committed file shows."""
    assert GPU_DOC.index("## What is proven") < GPU_DOC.index("## Supported layouts")
    section, rows, files = proven_table()
    header, body = rows[0], [r for r in rows[2:] if r[0].startswith("0.")]
    assert header == ["vLLM", "connector", "attention backend (KV cache)", "eager, sync", "eager, async", "compiled, sync", "compiled, async"]
    assert files and all((ROOT / f).is_file() for f in files.values()), files
    checked = 0
    for row in body:
        version, connector, backend, *cells = row
        name = backend.split()[0] + ("-fp8" if "fp8" in backend.split(")")[0] else "")
        prefix = CHAIN_PREFIX[connector] + ("native-" if "native" in backend else "")
        for (mode, loading), cell in zip(COLUMNS, cells):
            checked += 1
            cited = re.findall(r"\[(\w)\]", cell)
            can = [k for k, f in files.items() if _proven(ROOT / f, name, mode, loading, prefix, version=version)]
            wrong = [k for k, f in files.items() if _proven(ROOT / f, name, mode, loading, prefix, right=False, version=version)]
            if version not in thresholds.VLLM_PROVEN:
                assert cell.startswith("not run") and not cited, (row, cell)
            elif cell.startswith("proven"):  # it cites a file at least, and each file it cites shows it
                assert cited and all(k in can for k in cited), (row, mode, loading, cited, can)
            elif cell.startswith("wrong tokens"):  # each file it cites shows hits with other tokens, none shows it right
                assert cited and all(k in wrong for k in cited) and not can, (row, mode, loading, cited, wrong, can)
            else:  # "not run": no committed result file shows it
                assert cell.startswith("not run") and not can and not wrong, (row, mode, loading, can, wrong)
    assert checked >= 4 * 10 and sum(c.startswith("proven") for r in body for c in r[3:]) >= 20
    assert {r[0] for r in body} >= set(thresholds.VLLM_PROVEN) | set(thresholds.VLLM_API_CHECKED)
    assert {r[1] for r in body} == {"KvctlConnector", "LMCache's LMCacheConnectorV1"}
    said = " ".join(section.split())
    assert all(gpu in said for gpu in ("H200", "H100", "B200", "B300")) and "not run (needs two GPUs)" in said


def test_the_gpu_doc_says_one_thing_of_flashmla_sparse():
    """It started and passed on 2026-12-02 with CuTe DSL and QuACK: no table row says it did not start."""
    rows = [ln for ln in GPU_DOC.splitlines() if ln.startswith("| FLASHMLA_SPARSE")]
    assert rows and not [r for r in rows if "did not start" in r], rows
    assert "gpu_engine_tests-h200-2026-12-02-all.txt" in GPU_DOC


def test_the_readme_gpu_section_links_the_table():
    section = README.split("**On a GPU engine**", 1)[1].split("\n## ", 1)[0]
    assert "docs/gpu.md#what-is-proven" in section


# --- launch lines -----------------------------------------------------------------------------------------------------


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def test_a_launch_line_for_lmcaches_own_connector_on_a_gpu(tmp_path):
    """The config from kvctl's lmcache-config (its plugin), vLLM's built-in LMCacheConnectorV1 (no module path), the
    fixed hash seed restart hits need and the shutdown grace saves need."""
    factory = pytest.importorskip("vllm.distributed.kv_transfer.kv_connector.factory")  # the engine extra

    block = next(b for b in _bash_blocks(GPU_DOC) if "LMCacheConnectorV1" in b)
    assert "kvctl deploy-valkey lmcache-config --plugin --dir ./kv-tier > lmcache.yaml" in block
    assert "LMCACHE_CONFIG_FILE=lmcache.yaml" in block and "PYTHONHASHSEED=0" in block and "--shutdown-timeout 5" in block
    kvt = json.loads(re.search(r"--kv-transfer-config '(\{.*?\})'", block, re.S).group(1))
    # a hit LMCache cannot load in full is recomputed (vLLM's default fails its request: doctor's load_failure_policy;
    # vLLM's own parser reads this line in tests/tier/test_vllm_config.py)
    assert kvt == {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both", "kv_load_failure_policy": "recompute"}
    assert "LMCacheConnectorV1" in factory.KVConnectorFactory._registry  # vLLM's own name for it
    res = CliRunner().invoke(cli, ["deploy-valkey", "lmcache-config", "--target", "k8s", "--ranks", "1", "--plugin"])
    assert res.exit_code == 0 and "kvctl.plugins.lmcache" in res.output, res.output


def test_every_launch_of_kvctls_connector_gives_the_shutdown_grace():
    """vLLM's default --shutdown-timeout 0 kills the workers at once on SIGTERM and the connector's queued saves are lost
    without a word (docs/gpu.md): every launch line of KvctlConnector in README and docs/ gives a grace above save_drain_s."""
    section = README.split("## Engine wiring", 1)[1].split("\n## ", 1)[0]
    assert any("vllm.entrypoints.openai.api_server" in b and "--shutdown-timeout 5" in b for b in _bash_blocks(section))
    launches = [(p.name, b) for p in (ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))) for b in _bash_blocks(p.read_text())
                if "vllm.entrypoints.openai.api_server" in b and ("KvctlConnector" in b or "vllm-config" in b)]
    assert len(launches) >= 4 and not [x for x in launches if "--shutdown-timeout 5" not in x[1]], launches


def test_a_backend_vllm_refuses_is_skipped_with_vllms_own_reason():
    """vLLM 0.33 on the H100 (2026-12-07) refused FLASHINFER for the test model's head size, where the GPU test's skip
    said only "FlashInfer is not in the GPU host's bundle": the skip now quotes vLLM's own line from the engine's error."""
    from tests.engine.lab_chains import vllm_reason
    chains = _chains(RESULTS / "gpu_engine_tests-h100-2026-12-07-vllm033.json")
    said = {}
    for name in ("FLASHINFER", "CUTLASS_MLA"):
        c = chains[f"chain-{name}-eager"]
        said[name] = vllm_reason("\n".join([c["error"], *(s["error"] or "" for s in c["steps"])]))
    assert said["FLASHINFER"].startswith("ValueError: Selected backend") and "head_size not supported" in said["FLASHINFER"], said
    assert "compute capability not supported" in said["CUTLASS_MLA"], said
    assert vllm_reason("engine failed to start: RuntimeError: Engine core initialization failed. See root cause above.") \
        .startswith("engine failed")  # no cause line: the error's start
