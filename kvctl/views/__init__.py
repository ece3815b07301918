"""Views: every table, key-value list, message and plot a command shows of its result, one module per command.

A command (kvctl/commands/) parses its options, calls one library function and hands the result to its view
here; a view only reads the result and draws it through :mod:`kvctl.core.render` (rich tables, progress, plots,
JSON). Views compute nothing a result does not already hold, import no click and raise nothing of their own.

* :mod:`kvctl.views.bench` - ``kvctl bench``: the runs table, the --engines contention table, the scaling plot
* :mod:`kvctl.views.cost` - ``kvctl cost``: break-even, fit-t0, predict, rho, kv-size, report
* :mod:`kvctl.views.deploy` - ``kvctl deploy-valkey``: up, status, down, the rendered files
* :mod:`kvctl.views.diagnose` - ``kvctl diagnose``: the diagnosis, a capture's summary, stalls
* :mod:`kvctl.views.doctor` - ``kvctl doctor``: the checklist
* :mod:`kvctl.views.drill` - ``kvctl drill``: the scenarios, the drills' verdicts, the samples, the drill engine
* :mod:`kvctl.views.explain` - ``kvctl explain``: each request's story from the connector's trace, the answers counted
* :mod:`kvctl.views.exporter` - ``kvctl exporter``: where it serves, and that it stopped
* :mod:`kvctl.views.loading` - ``kvctl loading``: the modes files set, a flip's diffs and restart
* :mod:`kvctl.views.replay` - ``kvctl replay``: the dry run's schedule, a run's summary
* :mod:`kvctl.views.report` - ``kvctl report``: replay runs side by side
* :mod:`kvctl.views.runbook` - ``kvctl runbook``: the pages and their titles, one page drawn for a terminal
* :mod:`kvctl.views.sim` - ``kvctl simulate`` and ``kvctl plan``: one run, a fleet, a sweep, a plan, their plots
"""
