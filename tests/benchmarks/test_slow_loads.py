"""benchmarks/slow_loads.py: where a slow load's time went, from a connector trace's lane sums.

A trace written here, one load event per case, each built as the connector writes them (``plugins/vllm_timing.py``
``count_load``): a slow load whose every instance is slow, one whose one instance is, one that waited on its slots,
against median loads; then the kept 32k run of 2026-12-07 (no lane sums yet) read back as its note quoted it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks import slow_loads  # noqa: E402

MB = 1_000_000


def _load(t: float, get_s: float, per: list[float], wait: float = 0.0, given_up: bool = False,
          tail: float = 0.0003) -> dict:
    return {"t": t, "ev": "load", "req": f"r{t}", "rank": 0, "bytes": 400 * MB, "get_s": get_s, "total_s": get_s + 0.01,
            "copy_tail_s": tail, "given_up": given_up, "lanes": 8, "recv_s_by_instance": per, "slot_wait_s": wait}


def _trace(tmp_path: Path, events: list[dict]) -> str:
    p = tmp_path / "trace.jsonl"
    p.write_text("".join(json.dumps(e) + "\n" for e in events))
    return str(p)


def test_each_slow_load_is_put_where_its_time_went(tmp_path, capsys):
    even = [0.4, 0.4, 0.4, 0.4]
    events = [_load(10.0 + i, 0.2, even) for i in range(5)]
    events += [
        _load(20.0, 0.3, [0.6, 0.6, 0.6, 0.6]),  # every instance 1.5x: the client side
        _load(21.0, 0.3, [0.4, 0.4, 0.4, 0.8]),  # one instance 2x
        _load(22.0, 0.3, even, wait=0.9),  # its lanes waited on the device copies
        _load(23.0, 0.2, even, given_up=True, tail=0.3),  # given up, at a median pace, its copies late: none of these
    ]
    # a 16k step under the last two loads' GETs: they are beside one, the others alone
    events.append({"t": 23.5, "ev": "step", "step": 9, "prefill_tokens": 16384, "t_start": 21.5, "s": 2.0})
    trace = _trace(tmp_path, events)
    assert slow_loads.main([trace, "--json", str(tmp_path / "out.json")]) == 0
    res = json.loads((tmp_path / "out.json").read_text())
    assert res["lane_sums"] == 9
    assert res["groups"]["alone"]["where"] == {"every_instance": 1, "some_instances": 1, "slot_waits": 0,
                                               "none_of_these": 0, "no_lane_sums": 0}
    assert res["groups"]["beside"]["where"] == {"every_instance": 0, "some_instances": 0, "slot_waits": 1,
                                                "none_of_these": 1, "no_lane_sums": 0}
    by_t = {r["t"]: r for r in res["loads"]}
    assert by_t[20.0]["slowness"] == pytest.approx(1.5) and by_t[20.0]["instance_slowness"] == [1.5] * 4
    assert by_t[21.0]["instance_slowness"] == [1.0, 1.0, 1.0, 2.0]
    assert (res["groups"]["beside"]["long_copy_tail"], res["groups"]["alone"]["long_copy_tail"]) == (1, 0)
    assert "the slow loads" in capsys.readouterr().out


def test_a_trace_without_loads_is_a_one_line_error(tmp_path, capsys):
    trace = _trace(tmp_path, [{"t": 1.0, "ev": "step", "step": 1, "prefill_tokens": 512, "t_start": 0.9, "s": 0.1}])
    assert slow_loads.main([trace]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("slow_loads: ") and "\n" not in err
    assert slow_loads.main([trace, "--slow", "0.5"]) == 2
    good = _trace(tmp_path, [_load(1.0, 0.2, [0.4, 0.4])])
    capsys.readouterr()
    assert slow_loads.main([good, "--json", str(tmp_path / "no-such-dir" / "out.json")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("slow_loads: --json ") and "\n" not in err


def test_the_kept_32k_run_reads_back_as_its_note_said():
    """benchmarks/README.md, 2026-12-07 third: of 23 loads beside a big step 8 were slow or cut short, of 33 others 4;
    5 of the 23 had a copy tail of 50 ms or more, 1 of the 33."""
    trace = ROOT / "benchmarks/results/paper_gpu-h100-2026-12-07-s39-on/R5.connector-trace.jsonl"
    res = slow_loads.analyse(slow_loads.trace_loads(slow_loads.read_events(str(trace), "trace")[0]))
    assert (res["groups"]["beside"]["loads"], res["groups"]["beside"]["slow_or_given_up"]) == (23, 8)
    assert (res["groups"]["alone"]["loads"], res["groups"]["alone"]["slow_or_given_up"]) == (33, 4)
    assert (res["groups"]["beside"]["long_copy_tail"], res["groups"]["alone"]["long_copy_tail"]) == (5, 1)
    assert res["lane_sums"] == 0  # the run predates the lanes' sums


@pytest.mark.parametrize("run, loads, slow", [("s39fix-on", 56, 4), ("s39fix-on2", 54, 2), ("s39fix-sw05", 55, 2)])
def test_the_sixth_runs_lane_sums_show_no_load_slow_on_every_instance(run, loads, slow):
    """benchmarks/README.md, 2026-12-07 sixth: the same 32k design with the lanes' sums, twice without
    ``async_switch_ms`` and once with 0.5 ms. Every load carries its sums, and no slow load was slow on every
    instance, which a GIL held through a step would make: the switch interval had nothing to give back."""
    trace = ROOT / f"benchmarks/results/paper_gpu-h100-2026-12-07f-{run}/R5.connector-trace.jsonl"
    res = slow_loads.analyse(slow_loads.trace_loads(slow_loads.read_events(str(trace), "trace")[0]))
    g = res["groups"]
    assert res["lane_sums"] == loads == g["beside"]["loads"] + g["alone"]["loads"]
    assert g["beside"]["slow_or_given_up"] + g["alone"]["slow_or_given_up"] == slow
    assert g["beside"]["where"]["every_instance"] == g["alone"]["where"]["every_instance"] == 0
