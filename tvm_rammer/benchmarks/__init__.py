"""Benchmarks: every baseline side by side on the same device (issue 3).

In: zoo models and the systems to compare (tvm-rammer, TVM's default, Nimble-style CUDA graphs,
the floors). Out: tables, JSON and charts (``tvm-rammer bench``).
"""
