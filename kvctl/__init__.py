"""kvctl: the on-call toolkit for the remote KV-cache tier of LLM serving."""

__version__ = "0.1.0"
