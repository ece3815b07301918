"""benchmarks/head_of_line.py: the load decision where vLLM's scheduler makes it, at the head of its line (issue 46).

The model runs the connector's own ``decide`` and ``ArrivalRate``; these runs check what the benchmark's
README table rests on, with the H100's figures of 2026-12-06: on the tier whose lone hit loses by a hair (2.55 GB/s
a load), the decision without the line's credit recomputes every hit and the line grows through the run (as the
GPU run did); with it, about half the hits load and the line stays short; where the tier is fast the decision
loads what loading every hit does; where it is slow, nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks import head_of_line  # noqa: E402


def runs(tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    assert head_of_line.main([*args, "--json", str(out)]) == 0
    return {r["rule"]: r for r in json.loads(out.read_text())["runs"]}


def test_at_the_head_of_the_line_the_credit_keeps_a_saturated_tier_serving(tmp_path):
    r = runs(tmp_path, "--tier-gbps", "2.55", "--rate", "7.7")
    assert r["head"]["loaded_share"] == 0.0 and r["off"]["loaded_share"] == 1.0
    for rule in ("head", "off"):  # the line grows through the run
        first, _, last = r[rule]["thirds_p50_s"]
        assert last > 3 * first
    first, _, last = r["credit"]["thirds_p50_s"]
    assert last < 2 * first and 0.3 < r["credit"]["loaded_share"] < 1.0
    assert r["credit"]["p99_s"] < r["off"]["p99_s"] / 3 and r["credit"]["p99_s"] < r["head"]["p99_s"] / 5


def test_a_fast_tier_loads_like_off_and_a_slow_one_recomputes(tmp_path):
    fast = runs(tmp_path, "--tier-gbps", "10", "--rate", "7.7")
    assert fast["credit"]["loaded_share"] == 1.0 and fast["credit"]["p99_s"] == pytest.approx(fast["off"]["p99_s"])
    slow = runs(tmp_path, "--tier-gbps", "0.6", "--rate", "2.8", "--rules", "off,credit")
    assert slow["credit"]["loaded_share"] == 0.0 and slow["credit"]["p99_s"] < slow["off"]["p99_s"] / 10


def test_bad_arguments_are_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        head_of_line.main(["--rules", "sometimes"])
    assert e.value.code == 2 and "--rules of off,head,whole,credit" in capsys.readouterr().err
