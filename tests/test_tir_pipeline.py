"""tvm.compile's TIR lowering: persistent kernels skip passes prelower already ran. Skipping those
in SKIPPED gives the TIR TVM's pipeline makes; skipping REDONE_BY_NVCC as well changes the TIR but
not the SASS nvcc makes of it. Every other function gets TVM's pipeline unchanged."""

import pytest
import tvm
from tvm.tirx import compilation_pipeline

from tir_templates.cuda_resources import find_tool
from tir_templates.s_tir_passes import s_tir_passes
from tvm_rammer import RammerConfig
from tvm_rammer.codegen import tir_pipeline
from tvm_rammer.driver.frontend import import_onnx, lower
from tvm_rammer.views.inspection import lower_default
from tvm_rammer.models import REDUCED, get_model
from tvm_rammer.target import plain_target, rammer_target

TARGET = "rammer/nvidia-h100"


def _tvm_s_tir(mod):
    """TVM's own s_tir pipeline (the factory our wrapper wraps) over ``mod``."""
    import tvm.s_tir.pipeline as s_tir_pipeline

    pipeline, _, _ = s_tir_pipeline.default_s_tir_pipeline()
    return pipeline(mod)


def _ours(mod):
    pipeline, _, _ = compilation_pipeline.get_tir_pipeline("default")
    return pipeline(mod)


def _bound(funcs):
    target = plain_target(rammer_target(TARGET))
    mod = tvm.IRModule(funcs)
    return tvm.tirx.transform.BindTarget(target.with_host("llvm"))(mod), target


# AlexNet, not SqueezeNet: TVM's s_tir pipeline over reduced SqueezeNet's persistent kernel took
# 112 s and 157 s in these two tests on the 2-core CI machine, over AlexNet's ~22 s
@pytest.fixture(scope="module", params=["alexnet", "lstm_tc"])
def model(request):
    return import_onnx(get_model(request.param, **REDUCED[request.param]))


@pytest.fixture(scope="module")
def lowered(model):
    # bodies inline: outlining them into device functions (RammerConfig.rkernel_functions) is a
    # step of our pipeline TVM's has not (tests/test_rkernel_functions.py); here only the passes.
    # check_unmeasured=False: reduced AlexNet's rProgram is estimated slower than TVM's default
    # kernels and would fall back, leaving no persistent kernel to compare
    return lower(model, TARGET, RammerConfig(rkernel_functions=False, check_unmeasured=False))


def _split(mod):
    persistent = {gv: f for gv, f in mod.functions_items() if tir_pipeline.is_prelowered(f)}
    ordinary = {gv: f for gv, f in mod.functions_items()
                if isinstance(f, tvm.tirx.PrimFunc) and gv not in persistent}
    return persistent, ordinary


def test_the_default_tir_pipeline_is_the_prelowered_aware_one():
    factory = compilation_pipeline.PIPELINE_MAP["s_tir"]
    assert getattr(factory, tir_pipeline._MARK, False)
    tir_pipeline.install()  # idempotent: never wraps twice
    assert compilation_pipeline.PIPELINE_MAP["s_tir"] is factory


def test_the_skipped_passes_leave_persistent_kernels_as_tvms_pipeline_makes_them(lowered):
    persistent, _ = _split(lowered)
    assert persistent, "the reduced model should become at least one rProgram"
    mod, target = _bound(persistent)
    with target:
        ours = tvm.transform.Sequential(tir_pipeline.prelowered_passes(
            skipped=tir_pipeline.SKIPPED))(mod)
        theirs = _tvm_s_tir(mod)
    tvm.ir.assert_structural_equal(ours, theirs)


TVM_S_TIR = "rammer_test_tvm_s_tir"  # TVM's own s_tir pipeline, as registered before our wrapper


def _build(mod, target, pipeline):
    """``tvm.tirx.build`` with the TIR pipeline ``pipeline`` ("default": ours; TVM_S_TIR: TVM's)."""
    from tvm.s_tir.pipeline import default_s_tir_pipeline

    if TVM_S_TIR not in compilation_pipeline.PIPELINE_MAP:
        compilation_pipeline.register_tir_pipeline(TVM_S_TIR, default_s_tir_pipeline)
    return tvm.tirx.build(mod, target, pipeline=pipeline)


@pytest.mark.nvcc
@pytest.mark.skipif(find_tool("cuobjdump") is None or find_tool("nvdisasm") is None,
                    reason="needs cuobjdump and nvdisasm (pip install nvidia-cuda-cuobjdump "
                           "nvidia-cuda-nvdisasm)")
def test_the_passes_nvcc_redoes_do_not_change_the_sass(lowered):
    """The persistent kernel lowered by TVM's whole pipeline and by ours compiles to the same SASS
    (the listing without its header, which names the file)."""
    from tir_templates.cuda_resources import compile_cuda_sass, sass_opcodes
    from tvm_rammer.codegen.resources import module_cuda_source

    persistent, _ = _split(lowered)
    mod, target = _bound(persistent)
    found = []
    for pipeline in ("default", TVM_S_TIR):
        built = _build(mod, target, pipeline)
        resources, sass = compile_cuda_sass(module_cuda_source(built), "sm_90a")
        found.append(([line for line in sass.splitlines() if "/*" in line],
                      resources["registers"], resources.get("spills", 0)))
    assert found[0] == found[1]
    assert sum(sass_opcodes("\n".join(found[0][0])).values()) > 100  # a real kernel


def test_ordinary_kernels_and_mixed_modules_get_tvms_pipeline(model, lowered):
    persistent, _ = _split(lowered)
    _, ordinary = _split(lower_default(model, TARGET))  # TVM's default kernels of the same model
    assert persistent and ordinary
    mod, target = _bound({**persistent, **ordinary})
    with target:
        ours, theirs = _ours(mod), _tvm_s_tir(mod)
    assert sorted(gv.name_hint for gv in ours.get_global_vars()) == \
        sorted(gv.name_hint for gv in theirs.get_global_vars())
    for gv in theirs.get_global_vars():
        if gv.name_hint.startswith(tuple(g.name_hint for g in persistent)):
            continue  # a persistent kernel or its device part: the tests above
        tvm.ir.assert_structural_equal(ours[gv.name_hint], theirs[gv])


def _steps(pass_) -> list:
    return [p.info.name for p in pass_.passes]


def test_the_prelowered_list_is_tvms_list_with_the_skipped_passes_restricted():
    with tvm.transform.PassContext():
        ours = tir_pipeline.prelowered_passes()
        theirs = s_tir_passes({})
    full = [p.info.name for p in theirs]
    assert [p.info.name for p in ours] == full  # same passes, same order
    composite = {p.info.name: _steps(p) for p in theirs if isinstance(p, tvm.transform.Sequential)}
    for p in ours:  # a composite pass keeps its steps, in order
        if p.info.name in composite:
            assert _steps(p) == composite[p.info.name]
    assert not tir_pipeline.SKIPPED & tir_pipeline.REDONE_BY_NVCC
    for name in tir_pipeline.SKIPPED | tir_pipeline.REDONE_BY_NVCC:
        parent, _, step = name.rpartition("/")  # every name is a pass or a step TVM runs
        assert step in (composite[parent] if parent else full), name
