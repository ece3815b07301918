"""vLLM's own config loaders, for tests that check a rendered or edited config is accepted by the real consumer.

* ``kv_config(obj)``: ``vllm.config.KVTransferConfig(**obj)``, what the engine builds from the JSON;
* ``parse_serve_args(argv)``: vLLM's ``serve``/api_server argument parser
  (``FlexibleArgumentParser`` + ``make_arg_parser``), which reads ``--config FILE.yaml``
  through ``load_config_file`` and turns ``--kv-transfer-config`` into a ``KVTransferConfig``.

Building the parser imports most of vLLM (several seconds); it is built once per session.
Callers skip when vLLM (the engine extra) is not installed: ``pytest.importorskip("vllm")``.
"""

from __future__ import annotations

import argparse
import functools
import shlex
from typing import Any


def kv_config(obj: dict[str, Any]):
    from vllm.config import KVTransferConfig  # noqa: PLC0415

    return KVTransferConfig(**obj)


@functools.lru_cache(maxsize=1)
def serve_parser():
    try:  # where `vllm serve` takes it from: entrypoints/common since 0.33, entrypoints/launchers in 0.32
        from vllm.entrypoints.common.cli_args import make_arg_parser  # noqa: PLC0415
    except ImportError:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser  # noqa: PLC0415
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # noqa: PLC0415

    return make_arg_parser(FlexibleArgumentParser(exit_on_error=False))


def parse_serve_args(argv: list[str]) -> argparse.Namespace:
    """vLLM's parse of an api_server command line; a bad argument raises (argparse's SystemExit turned into AssertionError)."""
    try:
        return serve_parser().parse_args(list(argv))
    except SystemExit as e:  # argparse.error exits even with exit_on_error=False for some errors
        raise AssertionError(f"vLLM's parser rejected {argv!r} (exit {e.code})") from e


def kv_from_config_file(path) -> Any:
    """The KVTransferConfig vLLM builds from ``--config path`` (a YAML file)."""
    return parse_serve_args(["--config", str(path)]).kv_transfer_config


def kv_from_command_line(line: str) -> Any:
    """The KVTransferConfig vLLM builds from a shell command line (``shlex`` split, program words dropped)."""
    words = shlex.split(line)
    first = next(i for i, w in enumerate(words) if w.startswith("--"))
    return parse_serve_args(words[first:]).kv_transfer_config
