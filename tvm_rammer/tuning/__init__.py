"""rKernel versions and their times: an operator's PrimFuncs in, versions with measured (or
recorded, or analytical) times out (Rammer's compile-time profiling, section 3.2; issue 4).

- :mod:`.versions`, :mod:`.version_pool`, :mod:`.deferred`: the versions of an operator (dlight
  variants, templates), made in worker processes or only when used;
- :mod:`.measure`, :mod:`.profiler`: built and timed on the GPU (or a test's fake device);
- :mod:`.profile_db`, :mod:`.operator_record`: the records kept between compiles;
- :mod:`.tune`, :mod:`.cli`: ``tvm-rammer tune`` (MetaSchedule).

The policy that uses the times (``scheduling``) comes after this stage: what the records need
from it (the vDevice, a version's analytical time) is handed in by the back end.
"""
