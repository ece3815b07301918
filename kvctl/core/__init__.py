"""The bottom layer: errors, constants, file I/O, safe YAML, signals, child processes, the cost model, KV sizes,
engine HTTP reads, runbook links and rendering primitives. Imports no other kvctl package (kvctl.connector's pure
modules at most).
"""
