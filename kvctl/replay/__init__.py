"""Trace replay: trace readers, prompt building, the open-loop sender and run files.

* :mod:`kvctl.records.trace` reads the three trace formats into :class:`TraceRequest` s.
* :mod:`kvctl.replay.prompts` turns a request into the prompt the engine sees (token ids).
* :mod:`kvctl.replay.sender` sends requests at their original offsets (open loop, asyncio + aiohttp).
* :mod:`kvctl.records.runfile` writes and reads run files (``kvctl replay --out``): the one reader of them, the
  trace reader's too when a run file is given as a trace.
* :mod:`kvctl.records.jsonl` decodes JSONL line by line for both readers.
"""
