"""The GPU lease (issue 31): what is built on the CPU machine for a short GPU lease to load, run,
check and time, and what comes back. Its modules import TVM's compiler only where they build."""
