"""``kvctl doctor``'s checks of what is installed: py-spy may attach to a process it did not start, NVML sees the GPUs,
and the engine's vLLM release against the releases kvctl's connector is proven with."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from kvctl.core.errors import BinaryNotFound, KvctlError
from kvctl.core.thresholds import VLLM_API_CHECKED, VLLM_PROVEN
from kvctl.diagnose import sources
from kvctl.tier.checks import OK, WARNING, Check


#: Not --timeout: a host check that starts a local sleeper and attaches py-spy to it; py-spy's first attach
#: reads the target's symbols, seconds on a loaded host, and no deployment read is involved.
PYSPY_HOST_CHECK_TIMEOUT_S = 15.0


def check_py_spy(timeout_s: float = PYSPY_HOST_CHECK_TIMEOUT_S) -> Check:
    """py-spy present and allowed to attach to a process that is not our descendant (as an engine is not)."""
    from kvctl.diagnose.pyspy import PTRACE_HINT, PtraceNotPermitted, dump_threads, find_py_spy  # noqa: PLC0415

    try:
        binary = find_py_spy()
    except KvctlError as e:
        return Check("host", "py_spy", WARNING, str(e), "pip install py-spy (kvctl diagnose stalls needs it)")
    # an orphaned sleeper: its parent exits at once, so it is no longer our descendant (Yama scope 1 refuses those);
    # it sleeps 30 s at most, and exits within 0.1 s of this process (a killed doctor leaves nothing behind)
    sleeper = f"import os, time; print(1, flush=True); [time.sleep(0.1) or os.kill({os.getpid()}, 0) for _ in range(300)]"
    starter = (  # the sleeper says "ready" once its interpreter runs; its parent passes that on with the pid and exits
        f"import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', {sleeper!r}], "
        "stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True); "
        "p.stdout.readline(); print(p.pid)"
    )
    try:
        res = subprocess.run([sys.executable, "-c", starter], capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:  # one slow start must not abort the whole checklist
        return Check("host", "py_spy", WARNING, f"could not start a test process for py-spy within {timeout_s:g} s")
    try:
        pid = int(res.stdout.strip())
    except ValueError:
        return Check("host", "py_spy", WARNING, f"could not start a test process for py-spy: {res.stderr.strip()[:200]}")
    try:
        for attempt in range(20):  # bounded: a dump taken while the sleeper's thread state changes can fail
            try:
                dump_threads(pid, binary=binary, timeout_s=timeout_s)
                break
            except (PtraceNotPermitted, BinaryNotFound):
                raise
            except KvctlError:
                if attempt == 19:
                    raise
                time.sleep(0.1)
    except KvctlError as e:
        return Check("host", "py_spy", WARNING, f"py-spy cannot read another process's stacks: {e}", PTRACE_HINT, {"binary": binary})
    finally:
        try:
            os.kill(pid, 9)
        except OSError:
            pass
    return Check("host", "py_spy", OK, f"py-spy ({binary}) attaches to processes it did not start", evidence={"binary": binary})


def check_vllm_version(url: str, version: str) -> Check:
    """The release an engine's ``/version`` gave, against VLLM_PROVEN (ok) and VLLM_API_CHECKED (its connector API checked
    on CPU, no GPU engine run yet: a warning); any other release is untested (a warning naming the proven ones). A local
    build (``0.32.0+cu130``) is its release; a pre-release or a dev build is not."""
    release = version.split("+", 1)[0]
    proven = ", ".join(VLLM_PROVEN)
    evidence = {"url": url, "version": version, "proven": list(VLLM_PROVEN), "api_checked": list(VLLM_API_CHECKED)}
    table = "docs/gpu.md, What is proven"
    if release in VLLM_PROVEN:
        return Check("engine", "vllm_version", OK, f"vLLM {version}: proven with kvctl's connector in GPU engines ({table})", evidence=evidence)
    if release in VLLM_API_CHECKED:
        return Check("engine", "vllm_version", WARNING,
                     f"vLLM {version}: kvctl's connector is checked against its KV connector API and scheduler on CPU, but not run in a GPU engine yet",
                     f"vLLM {proven} is proven ({table}); watch the connector's start lines and hits (kvctl diagnose) on this release", evidence)
    return Check("engine", "vllm_version", WARNING, f"vLLM {version}: untested with kvctl's connector",
                 f"run vLLM {proven}, the release(s) proven ({table}), or check hits and the connector's start lines before relying on it", evidence)


def check_nvml() -> Check:
    gpu = sources.gpu_sample()
    if gpu.visible:
        return Check("host", "nvml", OK, f"NVML sees {len(gpu.utilization_pct)} GPU(s): {', '.join(gpu.names)}", evidence={"gpus": gpu.names})
    return Check("host", "nvml", WARNING, gpu.note or "no GPU visible", "run kvctl on the engine's node (nvidia-ml-py installed) so diagnose can tell a compute-bound engine from one waiting on the tier")
