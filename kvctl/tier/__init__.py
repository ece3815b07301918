"""kvctl.tier."""
