"""Issue 49 item 4: one diagnose run function. The sequence sample → analyse → save as the last diagnosis was written
twice, in ``kvctl diagnose``'s command (``_run``) and in the ``--watch`` loop (kvctl/diagnose/watch.py); both now call
kvctl.diagnose.run, the one place that saves a live diagnosis. Real HTTP metrics servers on 127.0.0.1."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from kvctl.diagnose.analysis import Params
from kvctl.diagnose.capture import last_diagnosis_path
from tests.diagnose.engine_text import EngineState
from tests.diagnose.metrics_server import MetricsServer

ROOT = Path(__file__).resolve().parents[2]


def _calls(name: str) -> list[str]:
    """Where kvctl/ calls ``name`` (a plain name or an attribute), as path:function."""
    found = []
    for path in sorted((ROOT / "kvctl").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Call) and (getattr(node.func, "attr", None) == name or getattr(node.func, "id", None) == name):
                    found.append(f"{path.relative_to(ROOT)}:{fn.name}")
    return sorted(set(found))


def test_a_live_diagnosis_is_saved_in_one_place():
    assert _calls("save_last_diagnosis") == ["kvctl/diagnose/run.py:diagnosed"]
    # the command samples through the run function: no window of its own, no analysis of a live capture of its own
    command = (ROOT / "kvctl" / "commands" / "diagnose.py").read_text()
    assert "save_last_diagnosis" not in command and "poll_until" not in command


def _texts() -> list[str]:
    before = EngineState()
    after = before.advance(requests=10, prompt_lengths=[16000] * 10, remote_read_bytes=1e9, remote_get_ms=[1] * 10)
    return [before.text(), after.text()]


def test_once_and_watch_save_what_they_return(tmp_path):
    from kvctl.diagnose import run  # noqa: PLC0415
    from kvctl.diagnose.capture import load_capture  # noqa: PLC0415

    params = Params(bytes_per_token=48437.5, prefill_rate=52200.0)
    with MetricsServer(_texts()) as srv:
        once = run.once([srv.url], [], 0.3, params, timeout_s=2, save_dir=tmp_path / "cap")
    saved = json.loads(last_diagnosis_path().read_text())
    assert saved["engine_urls"] == once.engine_urls == [srv.url] and saved["exit_code"] == int(once.exit_status)
    assert (saved["bytes_per_token"], saved["prefill_rate_tok_s"]) == (48437.5, 52200.0)
    assert load_capture(tmp_path / "cap").parameters == run.recorded(params) == {"bytes_per_token": 48437.5, "prefill_rate": 52200.0}

    with MetricsServer(_texts()) as srv:
        refreshes = list(run.watch([srv.url], [], 0.3, params, timeout_s=2, count=2))
    assert len(refreshes) == 2
    saved = json.loads(last_diagnosis_path().read_text())
    assert saved["created_at"] == refreshes[-1].created_at and saved["exit_code"] == int(refreshes[-1].exit_status)
    assert [d.bytes_per_token for d in refreshes] == [48437.5, 48437.5]
    assert refreshes[0].exit_status == once.exit_status  # the same states, the same verdict, once or watched
