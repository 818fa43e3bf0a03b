"""``tvm-rammer tune`` (filled in by the tuning work)."""


def register(sub, add_common, make_config):
    """Add the ``tune`` subcommand to the ``tvm-rammer`` parser."""
