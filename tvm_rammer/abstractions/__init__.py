"""The paper's abstractions (Rammer, OSDI'20, 3.1-3.3): rKernel, rOperator, rTask, vDevice, rProgram.

In: nothing of TVM's IR (plain Python objects). Out: the types every later stage speaks: the
scheduler fills rPrograms with rTasks, codegen turns an rProgram into a persistent kernel.

- :mod:`.rtask`: rKernel, rOperator, rTask and barrier-rTask;
- :mod:`.vdevice`: the virtualized parallel device (vEUs per SM, presets per GPU);
- :mod:`.rprogram`: per-vEU rTask queues built with Append and Wait.

Imports only ``rocm.targets`` (the AMD vDevice presets, data) beyond itself.
"""
