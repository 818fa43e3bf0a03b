"""Profiling, rKernel versions and MetaSchedule tuning (issue 4)."""
