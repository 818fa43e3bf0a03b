"""Scheduling: rOperators in, rProgram plans out (Rammer's policy, section 3.3, and the others).

In: the operators of a Relax module as rOperators with their rKernel versions and times
(:mod:`.rkernels`, with ``tuning``'s profiled or analytical timings) on a vDevice. Out: rProgram
plans (which rTask runs on which vEU, and what it waits for), their predicted timelines and the
checks that decide whether an rProgram is worth it without measurements.

- :mod:`.rkernels`: TVM PrimFuncs to rOperators (versions, analytical times) and back;
- :mod:`.cost_model`: the analytical time of an rTask and the fixed costs of an rProgram;
- :mod:`.policy`: Algorithm 1's primitives (SelectRKernels, SelectvEU, Append, Wait);
- :mod:`.policies`: the policies as plug-ins (rammer, ios, opara);
- :mod:`.critical_path`: the longest chain of dependent operators of a schedule;
- :mod:`.timeline`: a schedule's timeline, predicted by replay or decoded from a GPU run;
- :mod:`.unmeasured_check`: whether an rProgram beats TVM's default kernels with nothing measured.
"""
