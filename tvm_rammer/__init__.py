"""tvm-rammer."""
