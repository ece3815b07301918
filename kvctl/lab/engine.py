"""Engine processes for tests and benchmarks: a ``vllm.LLM`` in a child process, an OpenAI API server, a tier.

* :class:`LLMProcess` -- ``python -P -m kvctl.lab.child`` holds one ``vllm.LLM``
  (the connector config of ``kvctl deploy-valkey vllm-config``) and answers
  commands (:mod:`kvctl.lab.child`). Every wait is bounded: start (a py-spy
  dump of the child and its EngineCore goes into the log when the start runs
  past its bound, so a slow start says where it was), each command, the
  graceful stop (vLLM's own shutdown, so the connector drains its saves; then
  the process group this class started is killed, nothing else).
* :class:`ApiServer` -- ``python -m vllm.entrypoints.openai.api_server`` in its
  own session on a free loopback port; ``stop`` sends SIGTERM and waits
  (bounded) like an orchestrator would, then kills what is left of its group.
  It gets SIGTERM when this process dies (:func:`kvctl.core.procs.die_with_parent`);
  an :class:`LLMProcess` reads EOF on its stdin then, and exits.
* :class:`LabTier` -- ``kvctl deploy-valkey up`` / ``vllm-config`` / ``down``
  run as the commands a user types (a subprocess of this interpreter).

Children start with ``-P``: a ``kvctl/`` folder in the current directory is
never imported in their place. Torch and vLLM are imported in the children
only.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvctl.connector import metric_names as N
from kvctl.core.procs import die_with_parent, kill_group
from kvctl.tier.server import free_base_port, free_port

__all__ = ["ApiServer", "EngineError", "LLMProcess", "LabTier", "connector_format", "default_kv_cache_gb",
           "dummy_cuda_server_args", "engine_env", "kvctl", "pyspy_dump"]

#: seconds an engine may take to start before its log gets a py-spy dump and the start fails
START_TIMEOUT_S = 600.0
#: how long a graceful stop may take before the process group is killed
STOP_TIMEOUT_S = 60.0


def default_kv_cache_gb(total_bytes: int | None = None) -> float:
    """40 GiB, at most 30 % of the GPU's memory (vLLM skips its memory profile when given the KV cache's size, so the
    prefill's activations and the connector's buffers need that room: on an 80 GB H100, 29 GiB of weights and
    40 GiB of KV cache left a 16k prefill out of memory, 2026-12-05)."""
    if total_bytes is None:
        try:
            import torch
        except ImportError:  # parsed where torch is not (an analysis on a laptop): no GPU either
            return 40.0
        if not torch.cuda.is_available():  # parsed where no GPU is (the analysis, the tests): the H200's figure
            return 40.0
        total_bytes = torch.cuda.get_device_properties(0).total_memory
    return float(min(40, int(0.3 * total_bytes / 2**30)))


def dummy_cuda_server_args(backend: str, kv_cache_gb: float) -> list[str]:
    """The API server's arguments for a shaped model with dummy weights on one GPU: ``backend``'s attention and a KV
    cache of ``kv_cache_gb`` GiB (the benchmarks' engines)."""
    return ["--attention-backend", backend, "--load-format", "dummy", "--gpu-memory-utilization", "0.9",
            "--kv-cache-memory-bytes", str(int(kv_cache_gb * (1 << 30)))]


class EngineError(RuntimeError):
    """An engine process failed, answered an error, or did not answer in time; the message has its log's tail."""


def pythonpath_first(path: Path) -> str:
    """A PYTHONPATH with ``path`` first, then this process's own (an engine child finds the tree's kvctl and its test
    hooks, and still the packages this process found there: the GPU host's bundle is /tmp/site)."""
    return os.pathsep.join(p for p in (str(path), os.environ.get("PYTHONPATH", "")) if p)


def engine_env(*, device: str = "cuda", trace: Path | None = None, extra: dict | None = None) -> dict:
    """The environment of an engine child: offline, no usage stats, our trace file, and what each device needs."""
    env = dict(os.environ)
    env.update({
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1",
        "PYTHONHASHSEED": "0", "PYTHONUNBUFFERED": "1", "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "INFO"),
    })
    if device == "cuda":
        env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")  # the GPU bundle has no FlashInfer
        for k in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
            env.setdefault(k, "0" if k == "NCCL_NVLS_ENABLE" else "1")
    else:
        env.update({"VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"), "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                    "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1")})
    if trace is not None:
        env["KVCTL_CONNECTOR_TRACE"] = str(trace)
    env.update(extra or {})
    return env


def _tail(path: Path, n: int = 80) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return ""


def _tree(pid: int) -> list[int]:
    try:
        import psutil

        return [pid] + [c.pid for c in psutil.Process(pid).children(recursive=True)]
    except Exception:  # noqa: BLE001 - the process is gone
        return [pid]


def pyspy_dump(pids: list[int], timeout_s: float = 30.0) -> str:
    """``py-spy dump`` of each pid (what a slow start or a hang was doing); '' when py-spy is missing."""
    out = []
    for pid in pids:
        try:
            r = subprocess.run([sys.executable, "-m", "py_spy", "dump", "--pid", str(pid)], capture_output=True,
                               text=True, timeout=timeout_s)
            if r.returncode != 0:
                r = subprocess.run(["py-spy", "dump", "--pid", str(pid)], capture_output=True, text=True, timeout=timeout_s)
            out.append(f"--- py-spy dump of pid {pid} ---\n{r.stdout}{r.stderr}")
        except (OSError, subprocess.TimeoutExpired) as exc:
            out.append(f"--- py-spy dump of pid {pid} failed: {exc}")
    return "\n".join(out)


@dataclass
class LLMProcess:
    """One ``vllm.LLM`` in a child process (see the module docstring); start with :meth:`start`."""

    proc: subprocess.Popen
    log_path: Path
    reply_fd: int
    start_s: float = 0.0
    _buf: bytes = field(default=b"", repr=False)

    @classmethod
    def start(cls, model: str | Path, workdir: Path, *, llm_kwargs: dict | None = None, kv_transfer_config: dict | None = None,
              env: dict | None = None, python: str | None = None, timeout_s: float = START_TIMEOUT_S,
              name: str = "engine") -> "LLMProcess":
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        spec = {"model": str(model), "llm_kwargs": llm_kwargs or {}, "kv_transfer_config": kv_transfer_config}
        spec_path = workdir / f"{name}.spec.json"
        spec_path.write_text(json.dumps(spec, indent=1))
        log_path = workdir / f"{name}.log"
        rfd, wfd = os.pipe()
        env = dict(env if env is not None else engine_env())
        env["KVCTL_LAB_REPLY_FD"] = str(wfd)
        with open(log_path, "ab") as log:
            proc = subprocess.Popen([python or sys.executable, "-P", "-m", "kvctl.lab.child", str(spec_path)],
                                    stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, env=env,
                                    start_new_session=True, pass_fds=(wfd,), cwd=str(workdir))
        os.close(wfd)
        self = cls(proc, log_path, rfd)
        t0 = time.monotonic()
        try:
            ready = self._read(timeout_s, on_timeout_dump=True)
        except BaseException:
            self.kill()
            raise
        if not ready.get("ok"):
            self.kill()
            raise EngineError(f"engine {name} failed to start: {ready.get('error')}\n{ready.get('traceback', '')}\n"
                              f"{_tail(log_path)}")
        self.start_s = time.monotonic() - t0
        return self

    def _read(self, timeout_s: float, on_timeout_dump: bool = False) -> dict:
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                if on_timeout_dump:
                    with open(self.log_path, "a") as log:
                        log.write(f"\n=== kvctl.lab: no answer within {timeout_s:.0f} s; py-spy dumps follow ===\n")
                        log.write(pyspy_dump(_tree(self.proc.pid)))
                raise EngineError(f"engine gave no answer within {timeout_s:.0f} s (log {self.log_path}):\n{_tail(self.log_path)}")
            r, _, _ = select.select([self.reply_fd], [], [], min(left, 1.0))
            if r:
                chunk = os.read(self.reply_fd, 1 << 20)
                if not chunk:
                    raise EngineError(f"engine exited ({self.proc.poll()}) (log {self.log_path}):\n{_tail(self.log_path)}")
                self._buf += chunk
            elif self.proc.poll() is not None:
                raise EngineError(f"engine exited with {self.proc.returncode} (log {self.log_path}):\n{_tail(self.log_path)}")
        line, _, self._buf = self._buf.partition(b"\n")
        return json.loads(line)

    def call(self, op: str, timeout_s: float = 600.0, **args: Any) -> dict:
        """Send one command; its answer (``ok`` False raises :class:`EngineError`)."""
        if self.proc.poll() is not None:
            raise EngineError(f"engine exited with {self.proc.returncode}:\n{_tail(self.log_path)}")
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        self.proc.stdin.flush()
        ans = self._read(timeout_s)
        if not ans.get("ok"):
            raise EngineError(f"{op} failed: {ans.get('error')}\n{ans.get('traceback', '')}")
        return ans

    def generate(self, prompts: list[list[int]], max_tokens: int = 1, logprobs: int | None = 1, each: bool = True,
                 timeout_s: float = 600.0) -> list[dict]:
        return self.call("generate", timeout_s, prompts=prompts, max_tokens=max_tokens, logprobs=logprobs, each=each)["results"]

    def reset_prefix_cache(self) -> bool:
        return self.call("reset_prefix_cache", 60.0)["ok"]

    def metrics(self, prefixes: tuple[str, ...] = (N.PREFIX,)) -> dict:
        return self.call("metrics", 60.0, prefixes=list(prefixes))["metrics"]

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> float | None:
        """vLLM's graceful shutdown (the connector drains its saves); seconds it took, None if it had to be killed."""
        took = None
        if self.proc.poll() is None:
            try:
                took = float(self.call("shutdown", timeout_s).get("shutdown_s", 0.0))
                self.proc.wait(timeout=timeout_s)
            except (EngineError, OSError, subprocess.TimeoutExpired, ValueError):
                took = None
        self.kill()
        return took

    def kill(self) -> None:
        kill_group(self.proc, wait_s=10)
        try:
            os.close(self.reply_fd)
        except OSError:
            pass

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def connector_format(self) -> tuple[str, str]:
        """(model name, chunk format) the connector keys chunks with, from its start line (see :func:`connector_format`)."""
        return connector_format(self.log_text())


def connector_format(log_text: str) -> tuple[str, str]:
    """(model name, chunk format) from the connector's start line ``KvctlConnector rank 0/W: ..., model M, fmt F, ...``:
    what :func:`kvctl.connector.ownership.chunk_keys` needs to name a prompt's chunks as the engine does."""
    for line in log_text.splitlines():
        if "KvctlConnector rank 0/" in line and " model " in line and " fmt " in line:
            return line.split(" model ")[1].split(",")[0].strip(), line.split(" fmt ")[1].split(",")[0].strip()
    raise EngineError("the engine's log has no KvctlConnector start line (is the connector loaded?)")


@dataclass
class ApiServer:
    """vLLM's OpenAI-compatible server in its own session (see the module docstring)."""

    proc: subprocess.Popen
    port: int
    log_path: Path
    served_name: str

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @classmethod
    def start(cls, model: str | Path, workdir: Path, *, args: list[str] | None = None, kv_transfer_config: dict | None = None,
              env: dict | None = None, python: str | None = None, timeout_s: float = START_TIMEOUT_S,
              name: str = "server", served_name: str = "model") -> "ApiServer":
        workdir = Path(workdir)
        workdir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        cmd = [python or sys.executable, "-P", "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
               "--served-model-name", served_name, "--host", "127.0.0.1", "--port", str(port),
               "--enable-prompt-tokens-details", *(args or [])]
        if kv_transfer_config:
            cfg_path = workdir / f"{name}.kv-transfer.json"
            cfg_path.write_text(json.dumps(kv_transfer_config))
            cmd += ["--kv-transfer-config", cfg_path.read_text()]
        log_path = workdir / f"{name}.log"
        with open(log_path, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env or engine_env(), start_new_session=True,
                                    cwd=str(workdir), preexec_fn=die_with_parent(signal.SIGTERM))  # SIGTERM: vLLM's own shutdown
        self = cls(proc, port, log_path, served_name)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise EngineError(f"API server exited with {proc.returncode}:\n{_tail(log_path)}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(1.0)
        with open(log_path, "a") as log:
            log.write(f"\n=== kvctl.lab: /health not answering within {timeout_s:.0f} s; py-spy dumps follow ===\n")
            log.write(pyspy_dump(_tree(proc.pid)))
        kill_group(proc, wait_s=10)
        raise EngineError(f"API server not healthy within {timeout_s:.0f} s:\n{_tail(log_path)}")

    def complete(self, prompt: list[int], max_tokens: int = 1, timeout_s: float = 600.0) -> dict:
        body = json.dumps({"model": self.served_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
                           "logprobs": 1, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", body, {"content-type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.load(r)

    def metrics(self, timeout_s: float = 10.0) -> str:
        with urllib.request.urlopen(self.url + "/metrics", timeout=timeout_s) as r:
            return r.read().decode()

    def stop(self, grace_s: float = STOP_TIMEOUT_S, sig: int = signal.SIGTERM) -> float | None:
        """``sig`` to the server alone (as an orchestrator would), a bounded wait, then kill the group."""
        took = None
        if self.proc.poll() is None:
            t0 = time.monotonic()
            try:
                self.proc.send_signal(sig)
                self.proc.wait(timeout=grace_s)
                took = time.monotonic() - t0
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc, wait_s=10)
        return took

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""


def lmcache_kv_transfer_config(device: str = "cuda", policy: str | None = "recompute") -> dict:
    """The KV transfer config of an engine running LMCache 0.5.6's connector: vLLM's ``LMCacheConnectorV1`` on CUDA,
    kvctl's CPU KV path for it (``kvctl.plugins.lmcache_cpu``) on vllm-cpu; a hit that cannot be loaded in full is
    recomputed (``policy``; vLLM's default ``fail`` ends its request with an error: kvctl doctor's
    ``load_failure_policy``). ``policy`` None leaves vLLM's default."""
    cfg = ({"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"} if device == "cuda" else
           {"kv_connector": "KvctlLMCacheConnector", "kv_connector_module_path": "kvctl.plugins.lmcache_cpu", "kv_role": "kv_both"})
    return cfg if policy is None else dict(cfg, kv_load_failure_policy=policy)


class LabTier:
    """A local tier through kvctl's own commands: ``deploy-valkey up``, ``vllm-config``, ``down``."""

    def __init__(self, root: Path, *, ranks: int = 1, instances_per_rank: int = 1, maxmemory: str = "2gb",
                 io_threads: int | None = None, base_port: int | None = None) -> None:
        self.dir = Path(root)
        self.ranks, self.k = ranks, instances_per_rank
        args = ["deploy-valkey", "up", "--ranks", str(ranks), "--dir", str(self.dir), "--maxmemory", maxmemory, "--json",
                "--base-port", str(base_port or free_base_port(ranks * instances_per_rank))]
        if instances_per_rank != 1:
            args += ["--instances-per-rank", str(instances_per_rank)]
        if io_threads:
            args += ["--io-threads", str(io_threads)]
        self.state = json.loads(kvctl(*args))
        self.instances = self.state["instances"]

    def vllm_config(self, *extra: str) -> dict:
        return json.loads(kvctl("deploy-valkey", "vllm-config", "--dir", str(self.dir), "--json", *extra))

    def lmcache_engine(self, path: Path, env: dict, *, loading: str, chunk_tokens: int, native: bool = False,
                       device: str = "cuda", l1_gb: float = 0.2, policy: str | None = "recompute") -> tuple[dict, dict]:
        """(kv_transfer_config, env) of an engine running LMCache 0.5.6's own connector on this tier (issue 47).

        ``path``: where ``deploy-valkey lmcache-config`` writes its YAML (kvctl's RESP plugin, or LMCache's own
        resp:// client with ``native``), for ``loading`` and an L1 of ``l1_gb`` (a restarted engine's is empty: its
        hits come from the tier). On CUDA vLLM's ``LMCacheConnectorV1``; on vllm-cpu kvctl's CPU KV path
        (``kvctl.plugins.lmcache_cpu``). PYTHONHASHSEED is fixed: LMCache hashes chunks with Python's ``hash``, so a
        restart finds them only with the same seed."""
        kvctl("deploy-valkey", "lmcache-config", "--dir", str(self.dir), "--chunk-tokens", str(chunk_tokens),
              "--max-local-cpu-size", str(l1_gb), "--loading", loading, "--native" if native else "--plugin",
              "--out", str(path))
        return lmcache_kv_transfer_config(device, policy), dict(env, LMCACHE_CONFIG_FILE=str(path), PYTHONHASHSEED="0")

    def down(self) -> None:
        kvctl("deploy-valkey", "down", "--dir", str(self.dir), check=False)


def kvctl(*args: str, check: bool = True, timeout_s: float = 120.0) -> str:
    """Run one kvctl command as a user would (this interpreter, ``-P``); its stdout."""
    r = subprocess.run([sys.executable, "-P", "-c", "from kvctl.cli import main; main()", *args],
                       capture_output=True, text=True, timeout=timeout_s)
    if check and r.returncode != 0:
        raise EngineError(f"kvctl {' '.join(args)} exited {r.returncode}: {r.stderr.strip() or r.stdout.strip()}")
    return r.stdout


def temp_workdir(prefix: str = "kvctl-lab-") -> Path:
    return Path(tempfile.mkdtemp(prefix=prefix))
