"""Benchmarks: every baseline side by side on the same device (issue 3)."""
