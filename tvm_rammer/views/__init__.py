"""Views of a compiled model: what ``tvm-rammer inspect`` and ``timeline`` show.

In: an ONNX model or a compiled module (its report and schedules). Out: text, JSON, a Perfetto /
Chrome trace or a PNG.

- :mod:`.inspection`: schedule and launch counts under the rammer and the default pipeline;
- :mod:`.timeline_view`: pictures of ``scheduling.timeline`` (trace, Gantt chart).
"""
