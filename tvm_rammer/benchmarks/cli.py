"""``tvm-rammer bench`` (filled in by the benchmark harness)."""


def register(sub, add_common, make_config):
    """Add the ``bench`` subcommand to the ``tvm-rammer`` parser."""
