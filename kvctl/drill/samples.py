"""The samples bundled with kvctl (package data under ``kvctl/samples/``), made by ``kvctl drill overload``.

* ``overload-capture/``: a ``kvctl diagnose capture`` of the overload drill, for ``kvctl diagnose --from``;
* ``overload-run.jsonl``: the drill's ``kvctl replay`` run file, for ``kvctl report``;
* ``overload-trace.jsonl``: the drill's Mooncake-format trace, for ``kvctl replay`` and ``kvctl simulate --trace``;
* ``calib-trace.jsonl``: a calibration trace for the drill engine (low load, then a burst), to replay for the
  ``--fit-from`` run of ``kvctl simulate`` and ``kvctl plan`` (README, "Sizing a shared tier").
"""

from __future__ import annotations

from pathlib import Path

from kvctl.core.errors import KvctlError

SAMPLES_DIR = Path(__file__).resolve().parent.parent / "samples"
SAMPLES = {
    "capture": ("overload-capture", "kvctl diagnose --from {path}"),
    "run": ("overload-run.jsonl", "kvctl report {path}"),
    "trace": ("overload-trace.jsonl", "kvctl simulate --trace {path} --prefill-rate 40960 --bytes-per-token 274.5 --t0 0.05 --instance-gbps 0.004 --hits-from-trace"),
    # low load, then a burst (kvctl.drill.workload.calibration_lines): a calibration replay for simulate/plan --fit-from
    "calib": ("calib-trace.jsonl", "kvctl replay {path} --engine-url \"$(kvctl drill engine --dir ./kv-tier)\" --out calib.jsonl"),
}


def loader_gbps(model_config: str | None = None) -> tuple[float, float]:
    """(synchronous, asynchronous) GB/s of the drill engine's loaders on one instance, as `kvctl simulate`'s
    --instance-gbps and --async-instance-gbps: the sync loader GETs chunk by chunk, a round trip each
    (STREAM_CHUNKS_PER_S); the async one a prompt's chunks in one pipelined batch, one round trip and then the
    link (LINK_CHUNKS_PER_S). docs/drill.md: the time model."""
    from kvctl.core.cost import GB  # noqa: PLC0415
    from kvctl.drill import scenarios as S  # noqa: PLC0415
    from kvctl.drill.workload import Workload, sizes  # noqa: PLC0415

    chunk = sizes(model_config).chunk_bytes
    chunks = Workload(rate_per_s=1.0, duration_s=1.0).hit_chunks
    batch_s = chunks / S.LINK_CHUNKS_PER_S + S.CHUNK_RTT_S
    return S.STREAM_CHUNKS_PER_S * chunk / GB, chunks * chunk / batch_s / GB


def sample_paths() -> dict[str, Path]:
    """Each bundled sample's absolute path; KvctlError when the package was installed without them."""
    out = {k: SAMPLES_DIR / name for k, (name, _) in SAMPLES.items()}
    missing = [str(p) for p in out.values() if not p.exists()]
    if missing:
        raise KvctlError(f"bundled samples missing ({', '.join(missing)}): reinstall kvctl")
    return out


def sample_commands() -> dict[str, str]:
    """The command that uses each sample, with its path filled in."""
    paths = sample_paths()
    return {k: cmd.format(path=paths[k]) for k, (_, cmd) in SAMPLES.items()}
