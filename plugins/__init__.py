"""Thin glue that lets LMCache and vLLM load the kvctl connector (``kvctl.plugins``)."""
