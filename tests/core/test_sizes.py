"""Issue 48 item 8: one units convention for every size kvctl reads, and one meaning of --maxmemory.

Input `mb` was MiB (Valkey's spelling) while every MB kvctl prints is 10^6 bytes, so doctor's own example
`--chunk-bytes 12.4mb` (the paper's 12.4 MB chunk) parsed to 13,002,342 B. Now kB/MB/GB/TB are powers of 1000 and
KiB/MiB/GiB/TiB powers of 1024, in any case, through one parser (kvctl.core.sizes.parse_size) behind every
byte-sized option; README says it once. `--maxmemory` was the tier's total in `deploy-valkey up` and per instance
in `bench --embedded-maxmemory`: both are the tier's total now, split evenly over its instances.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.commands.options import ByteSize
from kvctl.core.errors import InvalidInput
from kvctl.core.sizes import parse_size
from tests.cli_helpers import _commands


def options_of_every_command():
    """(command, option, its long names) of every visible option of every command."""
    for name, cmd in _commands(cli):
        for p in cmd.params:
            if isinstance(p, click.Option) and not p.hidden:
                yield name, p, "/".join(o for o in p.opts + p.secondary_opts if o.startswith("--"))

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


@pytest.mark.parametrize("text, n", [
    ("12.4mb", 12_400_000), ("12.4MB", 12_400_000), ("12.4 MB", 12_400_000), ("400mb", 400_000_000), ("2g", 2 * 10**9),
    ("2GB", 2 * 10**9), ("1.5gb", 1_500_000_000), ("70kB", 70_000), ("1tb", 10**12), ("12.4e6", 12_400_000), ("4096", 4096),
    ("12MiB", 12 * 2**20), ("12mib", 12 * 2**20), ("64GiB", 64 * 2**30), ("64Gi", 64 * 2**30), ("1KiB", 1024), ("2TiB", 2 * 2**40),
    ("100b", 100), (4096, 4096),
])
def test_one_convention(text, n):
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "abc", "12 parsecs", "-5mb", "0", "1e", "nan", "inf", "1e999", "12.4mbit", True])
def test_refused(bad):
    with pytest.raises(InvalidInput):
        parse_size(bad)


def test_every_size_option_parses_the_same_way():
    """Every byte-sized option of every command reads 12.4mb as the paper's 12.4 MB chunk and 12MiB as 12 × 2^20."""
    sized = [(name, p) for name, p, key in options_of_every_command() if isinstance(p.type, ByteSize)]
    assert {"kvctl doctor", "kvctl bench", "kvctl deploy-valkey up"} <= {name for name, _ in sized}, sized
    for name, p in sized:
        for text, n in (("12.4mb", 12_400_000), ("12MiB", 12 * 2**20), ("2g", 2 * 10**9)):
            if p.type.min_bytes <= n <= p.type.max_bytes:
                assert p.type.convert(text, p, None) == n, (name, p.opts, text)


def test_doctor_example_is_the_paper_chunk():
    """doctor's help gives `--chunk-bytes 12.4mb` as the paper's chunk: it must parse to 12.4e6 bytes."""
    res = CliRunner().invoke(cli, ["doctor", "--help"], terminal_width=400)
    m = re.search(r"Bytes of one stored chunk \(([0-9.]+[a-zA-Z]+)", res.output)
    assert m, res.output
    assert parse_size(m.group(1)) == 12_400_000


def test_readme_states_the_convention_once_in_commands():
    section = README.split("\n## Commands", 1)[1].split("\n## ", 1)[0]
    paras = [p for p in section.split("\n\n") if "KiB" in p and "1000" in p]
    assert len(paras) == 1, paras
    assert "--maxmemory" in paras[0] and "total" in paras[0]


def _help(*args: str) -> str:
    return " ".join(CliRunner().invoke(cli, [*args, "--help"], terminal_width=400).output.split())


def test_maxmemory_means_the_tiers_total_everywhere():
    """Every maxmemory option is the total of the tier it sizes, split evenly over its instances, and its help says so."""
    opts = [(name, p) for name, p, key in options_of_every_command() if "maxmemory" in key]
    assert {name for name, _ in opts} == {"kvctl deploy-valkey up", "kvctl bench"}, opts
    for name, p in opts:
        assert "TOTAL" in p.help and "split evenly" in p.help, (name, p.help)


def test_bench_embedded_maxmemory_is_split_over_the_instances():
    """`bench --embedded 2 --embedded-maxmemory 64mb`: two instances of 32 MB each (it used to give each 64 MiB)."""
    res = CliRunner().invoke(cli, ["bench", "--embedded", "2", "--embedded-maxmemory", "64mb", "--chunk-bytes", "1e5", "--batch", "2",
                                   "--keys", "20", "--duration", "0.2", "--json"])
    assert res.exit_code == 0, res.output
    params = json.loads(res.stdout)["metadata"]["parameters"]
    assert params["embedded_maxmemory_bytes"] == 64_000_000
    assert params["embedded_maxmemory_per_instance_bytes"] == 32_000_000


def test_deploy_maxmemory_split(tmp_path):
    from kvctl.tier.spec import split_maxmemory

    assert split_maxmemory("400mb", 4) == 100_000_000
    with pytest.raises(InvalidInput, match="1MB"):
        split_maxmemory("1mb", 2)
