"""The records measurement and the what-if model share, on a floor below both (ARCHITECTURE.md, layer 2).

* :mod:`~kvctl.records.trace` -- a trace of requests (Mooncake / kvctl lines, a run file read as one);
* :mod:`~kvctl.records.runfile` -- a replay's run file: its rows, metadata and summary, read under one set of bounds;
* :mod:`~kvctl.records.summary` -- a run's summary: the columns of the paper's Table 2 (``kvctl report``);
* :mod:`~kvctl.records.prometheus` -- an engine's ``/metrics`` text, parsed and differenced;
* :mod:`~kvctl.records.stats` -- the one percentile definition (linear interpolation, as the paper) and means;
* :mod:`~kvctl.records.jsonl` -- bounded JSON lines, line-numbered errors.

Replay writes what these read, diagnose and the exporter read engines through ``prometheus``, report and the what-if
model (sim) read runs and traces through them: sim no longer imports ops, and ops no longer imports bench.
"""
