"""Engine-side sharded MLA KV store (imported as ``kvctl.connector``).

Runs inside engine processes: never imports click, rich or the CLI.
"""
