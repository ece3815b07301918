"""kvctl.commands."""
