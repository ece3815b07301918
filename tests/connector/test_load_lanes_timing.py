"""A load's GET lanes in its trace event (connector/fetch.py -> connector/datapath.py -> plugins/vllm_timing.py).

On an H100 (2026-12-07, 32k prompts at rho_tier 1.3) loads beside 16k prefill steps took up to 1.8x their usual
GET time, and the trace could not say where: it times a load's GETs as a whole. The load event now carries what
the device path's lanes summed: seconds in GETs, an instance each, and seconds waiting for a slot's copy to the
device. Fields are made by hand here; tests/connector/test_fetch.py measures them on real Valkey servers.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

pytest.importorskip("torch")

from kvctl.connector.datapath import _timing  # noqa: E402
from kvctl.connector.fetch import FetchStats  # noqa: E402
from kvctl.connector.trace import Trace  # noqa: E402
from kvctl.plugins.vllm_timing import count_load  # noqa: E402

pytestmark = pytest.mark.engine


class _Stats:
    def __init__(self) -> None:
        self.data: dict = {}

    def add(self, name, value, *labels) -> None:
        self.data[(name, *labels)] = self.data.get((name, *labels), 0) + value


def test_the_lanes_sums_reach_the_load_event(tmp_path):
    fetch = FetchStats(staged=4, got_bytes=4096, get_s=0.5, copy_tail_s=0.01, lanes=4,
                       recv_s_by_instance=(0.9, 1.7), slot_wait_s=0.2)
    t = _timing({"fetch": fetch, "protocol_s": 0.6}, agreed=4, t0=10.0, t_ins=10.6, t_end=10.7, events=None)
    assert (t.lanes, t.recv_s_by_instance, t.slot_wait_s) == (4, (0.9, 1.7), 0.2)
    host = _timing({"protocol_s": 0.6}, agreed=4, t0=10.0, t_ins=10.6, t_end=10.7, events=None)
    assert (host.lanes, host.recv_s_by_instance, host.slot_wait_s) == (0, (), 0.0)  # the host path has no lanes
    path = tmp_path / "trace.jsonl"
    spec = SimpleNamespace(req_id="r", end_chunk=4, first_chunk=0, is_async=True, budget_s=1.0)
    count_load(_Stats(), Trace(str(path)), 0, 256, spec, SimpleNamespace(timing=t, agreed=4, written=4), [])
    ev = json.loads(path.read_text())
    assert ev["ev"] == "load" and ev["lanes"] == 4 and ev["recv_s_by_instance"] == [0.9, 1.7] and ev["slot_wait_s"] == 0.2
