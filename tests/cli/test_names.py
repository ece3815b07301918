"""One name per quantity (issue 31, item 4): docs/reference.md's "Names" table is pinned to click's command tree.

* every option of every command is a row of the table (its first cell);
* no quantity has two names: every row names one quantity and no two rows name the same one;
* every old name an option still takes (``RenamedOption``: hidden, one release) is in its row, warns on stderr,
  and means what the new name means;
* every byte-sized option goes through the one size parser (``ByteSize``).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from kvctl.cli import cli
from kvctl.commands.options import ByteSize, RenamedOption
from tests.cli_helpers import _commands

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
GLOBAL = {"--json", "--help", "--verbose"}


def names_table() -> dict[str, dict[str, str]]:
    """Rows of the table under "## Names: one per quantity", keyed by the option's name (first cell)."""
    section = REFERENCE.split("## Names: one per quantity", 1)[1].split("\n### ", 1)[0]
    rows = {}
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        m = re.fullmatch(r"`(--[a-z0-9-]+(?:/--[a-z0-9-]+)?)`", cells[0]) if len(cells) == 5 else None
        if m:
            assert m.group(1) not in rows, f"{m.group(1)} has two rows"
            rows[m.group(1)] = dict(zip(("name", "quantity", "commands", "json", "old"), cells))
    return rows


def options_of_every_command():
    """(command, option, its table key) of every visible option, and the RenamedOptions."""
    for name, cmd in _commands(cli):
        for p in cmd.params:
            if not isinstance(p, click.Option) or p.hidden:
                continue
            longs = [o for o in p.opts + p.secondary_opts if o.startswith("--")]
            if not longs or GLOBAL & set(longs):
                continue
            yield name, p, "/".join(longs)


def test_the_table_parser_sees_the_table():
    rows = names_table()
    assert len(rows) > 80 and "--valkey" in rows and rows["--valkey"]["old"] == "`--url`"


def test_every_option_of_every_command_is_in_the_names_table():
    rows = names_table()
    missing = sorted({f"{key} ({name})" for name, _, key in options_of_every_command() if key not in rows})
    assert not missing, f"options missing from docs/reference.md's Names table: {missing}"
    unused = sorted(set(rows) - {key for _, _, key in options_of_every_command()})
    assert not unused, f"rows of the Names table no command has: {unused}"


def test_no_quantity_has_two_names():
    quantities: dict[str, str] = {}
    for key, row in names_table().items():
        q = re.sub(r"\s+", " ", row["quantity"]).strip().lower()
        assert q, f"{key} names no quantity"
        assert q not in quantities, f"{key} and {quantities[q]} name one quantity: {q!r}"
        quantities[q] = key


def test_every_old_name_is_listed_in_its_row_and_hidden():
    rows = names_table()
    seen = []
    for name, p, key in options_of_every_command():
        if isinstance(p, RenamedOption):
            for old in p.old_names:
                seen.append(old)
                assert f"`{old}`" in rows[key]["old"], f"{name} {key}: old name {old} not in the table's row"
                helped = CliRunner().invoke(cli, [*name.split()[1:], "--help"]).output
                assert not re.search(re.escape(old) + r"(?![\w-])", helped.split("Options:", 1)[-1].replace(key, "")), (name, old)
    assert {"--url", "--bandwidth-gbps", "--target-rho", "--rate", "--tokens", "--config", "--chunk-size", "--async-loading"} <= set(seen)


@pytest.mark.parametrize("old, new", [
    (["cost", "rho", "--arrival-rate", "1.21", "--prompt-gb", "0.79", "--bandwidth-gbps", "0.85", "--target-rho", "0.4"],
     ["cost", "rho", "--arrival-rate", "1.21", "--prompt-gb", "0.79", "--instance-gbps", "0.85", "--rho-target", "0.4"]),
    (["cost", "predict", "--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--bandwidth-gbps", "10.76", "--tokens", "16384", "8192"],
     ["cost", "predict", "--bytes-per-token", "48437.5", "--prefill-rate", "52200", "--tier-gbps", "10.76", "--prompt-tokens", "16384", "8192"]),
    (["simulate", "--rate", "1.21", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5", "--prefill-rate", "52200",
      "--instance-gbps", "0.85", "--requests", "200"],
     ["simulate", "--arrival-rate", "1.21", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5", "--prefill-rate", "52200",
      "--instance-gbps", "0.85", "--requests", "200"]),
    (["deploy-valkey", "vllm-config", "--target", "k8s", "--ranks", "2", "--async-loading"],
     ["deploy-valkey", "vllm-config", "--target", "k8s", "--ranks", "2", "--loading", "async"]),
])
def test_an_old_name_warns_on_stderr_and_means_the_new_one(old, new):
    a, b = CliRunner().invoke(cli, [*old, "--json"]), CliRunner().invoke(cli, [*new, "--json"])
    assert a.exit_code == b.exit_code == 0, (a.output, b.output)
    assert json.loads(a.stdout) == json.loads(b.stdout)
    assert re.search(r"warning: --[a-z-]+ is renamed --[a-z-]+", a.stderr) and "renamed" not in b.stderr


def test_old_and_new_names_of_one_option_together_are_a_usage_error():
    res = CliRunner().invoke(cli, ["cost", "rho", "--arrival-rate", "1", "--prompt-gb", "1", "--instance-gbps", "1", "--bandwidth-gbps", "2"])
    assert res.exit_code == 2 and "give every value as --instance-gbps" in res.output


def test_json_keys_renamed_in_this_release(tmp_path):
    """One key per quantity: n* is min_hit_tokens, λ arrival_rate_per_s, the ρ target rho_target, everywhere."""
    section = REFERENCE.split("### Renamed in this release", 1)[1]
    for old, new in [("n_star_tokens", "min_hit_tokens"), ("offered_rate", "arrival_rate_per_s"), ("target_rho", "rho_target")]:
        assert f"`{old}`" in section and f"`{new}`" in section
    plan = json.loads(CliRunner().invoke(cli, ["plan", "--arrival-rate", "1.21", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5",
                                               "--prefill-rate", "52200", "--instance-gbps", "1.345", "--slo-p99", "1", "--requests", "500",
                                               "--max-instances", "2", "--json"]).stdout)
    assert "min_hit_tokens" in plan and "n_star_tokens" not in plan
    sim = json.loads(CliRunner().invoke(cli, ["simulate", "--arrival-rate", "1.21", "--prompt-tokens", "16310", "--bytes-per-token", "48437.5",
                                              "--prefill-rate", "52200", "--instance-gbps", "1.345", "--requests", "200", "--json"]).stdout)
    assert "arrival_rate_per_s" in sim and "offered_rate" not in sim
    rho = json.loads(CliRunner().invoke(cli, ["cost", "rho", "--arrival-rate", "1.21", "--prompt-gb", "0.79", "--instance-gbps", "0.85", "--json"]).stdout)
    assert {"rho_target", "instances_for_rho_target", "instance_gbps"} <= set(rho) and "target_rho" not in rho


def test_every_byte_sized_option_takes_one_size_syntax():
    """`--chunk-bytes` took 12.4e6 but not 12.4mb in bench and the reverse in doctor (issue 31): every option whose
    value is a number of bytes is a ByteSize, and each spelling means the same bytes in every command."""
    sized = [(name, key) for name, p, key in options_of_every_command()
             if re.search(r"bytes|maxmemory", key) and not key.startswith("--bytes-per")]
    assert sized and all(isinstance(p.type, ByteSize) for name, p, key in options_of_every_command() if (name, key) in sized), sized
    for text, n in [("12.4e6", 12_400_000), ("12400000", 12_400_000), ("12MiB", 12 * 2**20), ("12.4mb", 12_400_000), ("2g", 2 * 10**9)]:
        for name, p, key in options_of_every_command():
            if (name, key) in sized and n <= p.type.max_bytes:
                assert p.type.convert(text, p, None) == n, (name, key, text)
