"""kvctl.bench."""
