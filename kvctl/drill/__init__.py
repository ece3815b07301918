"""On-call drills: a real local tier, a drill engine that really GETs and SETs on it, a replay, and diagnose.

* :mod:`kvctl.drill.config` writes and reads the drill engine's config file (LMCache-style YAML whose
  ``enable_async_loading`` line is the one ``kvctl loading`` flips).
* :mod:`kvctl.drill.engine` is the drill engine: an OpenAI-compatible server with vLLM's ``/metrics``
  names, a simulated GPU and real tier traffic through :class:`kvctl.connector.resp.RespClient`
  (``python -m kvctl.drill.engine --config FILE --port N``). Torch-free. A teaching and self-test tool,
  never a stand-in for vLLM in the engine tests.
* :mod:`kvctl.drill.native_client` is the fixed-header RESP reader of the ``missing-key-stall`` drill.
* :mod:`kvctl.drill.workload` builds the drill's Mooncake-format trace.
* :mod:`kvctl.drill.scenarios` names the scenarios, what each plants and how its diagnosis is judged.
* :mod:`kvctl.drill.run` starts everything, watches it with diagnose, narrates, and stops it all.
* :mod:`kvctl.drill.samples` finds the bundled samples (``kvctl/samples/``).
"""
