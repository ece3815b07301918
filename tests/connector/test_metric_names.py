"""One place for the kvctl:* metric names (issue 22): kvctl.connector.metric_names.

The engine registers them (plugins/vllm_stats.py), the drill engine exports them, and diagnose, the
fleet view, report and doctor read them. Read from the sources with ``ast``: every string that IS a
kvctl metric name (``"kvctl:chunks_hit"``, not a sentence that mentions one) must be a name the module
defines, and the readers in kvctl/ hold none of their own: they import the module's constants. The same
for the vLLM and LMCache names kvctl reads (issue 32 item 5): each is defined there once, and no module of
kvctl/ (every one is held to it: the readers are derived, not listed) spells one out.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from kvctl.connector import metric_names as N

ROOT = Path(__file__).resolve().parents[2]
NAME = re.compile(r"kvctl:[a-z][a-z0-9_]*")
DEFINED = set(N.COUNTERS) | set(N.GAUGES) | {N.RANKS}
MODULE = ROOT / "connector" / "metric_names.py"
EVERYWHERE = sorted(p for d in ("kvctl", "connector", "plugins") for p in (ROOT / d).rglob("*.py") if p != MODULE)
#: the vLLM and LMCache names kvctl reads, and the module's constants of them
ENGINE_NAME = re.compile(r"(?:vllm|lmcache):[a-z][a-z0-9_]*")
ENGINE_DEFINED = set(N.ENGINE_NAMES)
#: the readers that must import the names: every module of kvctl/, derived (the engine-side writers in plugins/
#: are held to the weaker rule: every literal they use is a defined name)
READERS = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "kvctl").rglob("*.py"))


def name_literals(tree: ast.AST, name: re.Pattern[str] = NAME) -> list[tuple[int, str]]:
    """(line, text) of every string constant that is exactly a kvctl metric name (docstrings and messages
    that mention one are sentences, not names)."""
    return [(n.lineno, n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and name.fullmatch(n.value)]


def test_the_module_names_each_counter_once_and_every_constant_is_registered():
    constants = {v for k, v in vars(N).items() if k.isupper() and isinstance(v, str) and NAME.fullmatch(v)}
    assert constants == DEFINED  # every named constant is a registered counter or the ranks gauge, and back
    assert all(n.startswith(N.PREFIX) for n in DEFINED)


def test_the_scan_finds_names_and_skips_sentences():
    tree = ast.parse('D.total("kvctl:chunks_hit")\nx = "kvctl:ranks is W"\n"""mentions kvctl:l2_get_bytes"""\n')
    assert name_literals(tree) == [(1, "kvctl:chunks_hit")]


@pytest.mark.parametrize("path", EVERYWHERE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_kvctl_name_in_the_code_is_defined_once(path):
    unknown = [(n, v) for n, v in name_literals(ast.parse(path.read_text())) if v not in DEFINED]
    assert not unknown, f"{path.relative_to(ROOT)}: kvctl metric names not in kvctl.connector.metric_names: {unknown}"


@pytest.mark.parametrize("rel", READERS)
def test_readers_import_the_names(rel):
    tree = ast.parse((ROOT / rel).read_text())
    found = name_literals(tree) + name_literals(tree, ENGINE_NAME)
    assert not found, f"{rel} restates metric names instead of importing kvctl.connector.metric_names: {found}"


def test_the_readers_are_every_module_of_kvctl():
    """The list was kept by hand and missed the exporter and the drill (issue 32): now it is derived."""
    wanted = {"kvctl/diagnose/analysis.py", "kvctl/diagnose/quantities.py", "kvctl/diagnose/fleet.py", "kvctl/records/summary.py",
              "kvctl/ops/doctor.py", "kvctl/ops/exporter.py", "kvctl/drill/run.py", "kvctl/drill/engine.py"}
    assert wanted <= set(READERS) and len(READERS) > 80


def test_each_engine_name_is_defined_once_and_scanned_as_a_name():
    constants = [v for k, v in vars(N).items() if k.isupper() and isinstance(v, str) and ENGINE_NAME.fullmatch(v)]
    assert sorted(constants) == sorted(ENGINE_DEFINED) and len(constants) == len(set(constants))
    tree = ast.parse('D.total("vllm:e2e_request_latency_seconds")\nx = "lmcache:num_hit_tokens is 0"\n')
    assert name_literals(tree, ENGINE_NAME) == [(1, "vllm:e2e_request_latency_seconds")]


@pytest.mark.parametrize("path", EVERYWHERE, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_engine_name_in_the_code_is_defined_once(path):
    unknown = [(n, v) for n, v in name_literals(ast.parse(path.read_text()), ENGINE_NAME) if v not in ENGINE_DEFINED]
    assert not unknown, f"{path.relative_to(ROOT)}: vLLM/LMCache metric names not in kvctl.connector.metric_names: {unknown}"
