"""Sync/async loading of a deployed engine: the config edits (edit), vLLM's flags (vllm), their shared types,
and the safe check -> plan -> apply -> restart workflow (flip).
"""
