"""kvctl.diagnose."""
