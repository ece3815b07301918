"""``kvctl cost``: break-even, fit-t0, predict, rho, kv-size and the report's table (results from :mod:`kvctl.core.cost`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvctl.core import cost

from kvctl.core import render

if TYPE_CHECKING:
    from kvctl.core.kvsize import KvSize


def show_breakeven(res: cost.Breakeven, as_json: bool) -> None:
    """``kvctl cost breakeven``: B* (and per rank), and n* with a T0."""
    if as_json:
        data = render.to_jsonable(res)
        if res.min_hit_tokens is None:  # no --t0
            data.pop("t0_s")
            data.pop("min_hit_tokens")
        render.emit_json(data)
        return
    pairs = [
        ("bytes per token (s, whole model)", res.bytes_per_token),
        ("prefill rate (R, tok/s)", res.prefill_rate_tok_s),
        ("break-even bandwidth B* = s·R (GB/s, whole tier)", res.breakeven_gbps),
    ]
    if res.tp > 1:
        pairs += [
            (f"bytes per token per rank (s/{res.tp})", res.bytes_per_token_per_rank),
            (f"B* per instance, one per rank (B*/{res.tp}, GB/s)", res.breakeven_gbps_per_rank),
        ]
    if res.min_hit_tokens is not None:
        pairs += [("fixed cost T0 (s)", res.t0_s), ("min hit tokens n* = R·T0", round(res.min_hit_tokens))]
    render.key_values("Break-even", pairs, caption="A tier slower than B* makes every hit slower than recompute.")


def show_fit_t0(t0: float, latency_s: float, prompt_bytes: float, tier_gbps: float, as_json: bool) -> None:
    """``kvctl cost fit-t0``: the transfer time and the T0 fitted."""
    if as_json:
        render.emit_json({"t0_s": t0, "latency_s": latency_s, "prompt_gb": prompt_bytes / cost.GB, "bandwidth_gbps": tier_gbps})
        return
    render.key_values("Fitted fixed cost", [("transfer n·s/B (s)", prompt_bytes / (tier_gbps * cost.GB)), ("T0 (s)", t0)])


def show_predict(preds: list[cost.Prediction], bytes_per_token: float, tp: int, prefill_rate: float, t0: float, tier_gbps: float,
                 as_json: bool) -> None:
    """``kvctl cost predict``: load or recompute, per prompt length."""
    if as_json:
        render.emit_json({"bytes_per_token": bytes_per_token, "bytes_per_token_per_rank": bytes_per_token / tp, "tp": tp,
                          "prefill_rate_tok_s": prefill_rate, "t0_s": t0, "bandwidth_gbps": tier_gbps, "predictions": preds})
        return
    render.table(
        f"Load vs recompute at {tier_gbps:g} GB/s",
        ["tokens", "recompute s", "load s", "speedup", "verdict"],
        [(p.tokens, p.recompute_s, p.load_s, f"{p.speedup:.2f}×", p.verdict) for p in preds],
    )


def show_rho(res: cost.RhoResult, as_json: bool, bytes_per_token: float | None, tp: int) -> None:
    """``kvctl cost rho``: ρ of one instance, the instances for the target, ρ with one per rank; the JSON adds s
    (and its per-rank share) when the request's bytes came from it (``bytes_per_token``)."""
    if as_json:
        data = render.to_jsonable(res)
        if bytes_per_token is not None:
            data.update(bytes_per_token=bytes_per_token, bytes_per_token_per_rank=bytes_per_token / tp)
        if tp == 1:
            data.pop("rho_one_instance_per_rank")
        render.emit_json(data)
        return
    render.key_values(
        "Synchronous-load queue",
        [
            ("arrival rate λ (req/s)", res.arrival_rate_per_s),
            ("KV per request (GB)", res.prompt_gb),
            ("bandwidth B of one instance (GB/s)", res.instance_gbps),
            ("ρ = λ·n·s/B (one instance)", res.rho),
            ("stable (ρ < 1)", res.stable),
            (f"instances for ρ ≤ {res.rho_target:g}", res.instances_for_rho_target),
        ]
        + ([(f"ρ with {res.tp} instances, one per rank (each s/{res.tp})", res.rho_one_instance_per_rank)] if res.tp > 1 else []),
        caption=None if res.stable else "ρ ≥ 1: the queue grows without bound — add instances or switch to async loading.",
    )


def show_kv_size(res: KvSize, as_json: bool) -> None:
    """``kvctl cost kv-size``: the model's KV bytes per token (whole, per rank) and per chunk."""
    if as_json:
        render.emit_json(res)
        return
    render.key_values(
        f"KV size of {res.model}",
        [
            ("attention", res.attention),
            ("layers", res.layers),
            ("elements per token per layer", res.elements_per_token_per_layer),
            ("dtype", f"{res.dtype} ({res.dtype_source})"),
            ("tp ranks", res.tp if res.kv_head_copies == 1 else f"{res.tp} (each KV head on {res.kv_head_copies} ranks; s counts every copy)"),
            ("bytes per token (s, whole model)", res.bytes_per_token),
        ]
        + ([(f"  latent rows ({res.layers} layers x {res.latent_row_bytes} B)", res.bytes_per_token - res.indexer_bytes_per_token),
            (f"  indexer keys ({res.indexer_layers} layers x {res.indexer_row_bytes} B)", res.indexer_bytes_per_token)]
           if res.indexer_layers else [])
        + ([(f"bytes per token per rank (s/{res.tp})", res.bytes_per_token_per_rank)] if res.tp > 1 else [])
        + [
            (f"chunk bytes ({res.chunk_tokens} tokens, {'two stored values' if res.indexer_layers else 'one stored value'}, MB)",
             res.chunk_bytes / cost.MB),
        ],
        caption="B* = s·R against the whole tier's bandwidth; s/tp·R against one instance's (one per rank).",
    )


def show_pairing(rep: cost.PairingReport, as_json: bool) -> None:
    """``kvctl cost report``: one pairing's table (or its JSON)."""
    if as_json:
        render.emit_json({"pairings": [rep]})
        return
    render_pairing(rep)


def render_pairing(rep: cost.PairingReport) -> None:
    """The report table: rows are prompt lengths, one load column per bandwidth."""
    cols = ["tokens", "recompute s"]
    for bv in rep.bandwidths:
        cols.append(f"load s @ {bv.bandwidth_gbps:g} GB/s")
    rows = []
    for i, p0 in enumerate(rep.bandwidths[0].predictions):
        row: list[Any] = [p0.tokens, p0.recompute_s]
        for bv in rep.bandwidths:
            p = bv.predictions[i]
            mark = "[green]load[/]" if p.verdict == "load" else "[red]recompute[/]"
            row.append(f"{p.load_s:.3f} {mark}")
        rows.append(row)
    cross = ", ".join(
        f"{bv.bandwidth_gbps:g} GB/s → {'never' if bv.crossover_tokens is None else f'>{bv.crossover_tokens:,.0f} tok'}"
        for bv in rep.bandwidths
    )
    caption = (
        f"s = {rep.bytes_per_token:,.1f} B/token (whole model"
        + (f"; {rep.bytes_per_token_per_rank:,.1f} per rank at tp {rep.tp}" if rep.tp > 1 else "")
        + f") · R = {rep.prefill_rate_tok_s:,.0f} tok/s · T0 = {rep.t0_s:g} s\n"
        f"B* = s·R = {rep.breakeven_gbps:.3f} GB/s · n* = R·T0 = {rep.min_hit_tokens:,.0f} tokens\n"
        f"loading wins: {cross}"
    )
    render.table(rep.name, cols, rows, caption=caption)
