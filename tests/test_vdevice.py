"""VDevice: occupancy by NVIDIA's rules (cuda_occupancy.h) and vEU sizing by the most demanding rTask."""
from types import SimpleNamespace

import pytest

from tvm_rammer.abstractions.rtask import RKernel
from tvm_rammer.abstractions.vdevice import VDevice

H100 = VDevice.for_arch("sm_90")


def kernel(threads, registers=None, shared=0, rtasks=8):
    return RKernel("k", rtasks, threads, registers, shared, 1.0, "test")


@pytest.mark.parametrize(
    "threads, regs, smem, blocks",
    [
        (256, 32, 0, 8),        # warps: 64 / 8 warps = 8; regs: 1024/warp -> 64 warps
        (1024, 64, 0, 1),       # regs: 2048/warp -> 32 warps/SM = one block of 32 warps
        (128, 32, 0, 16),       # warps: 64 / 4
        (32, 16, 0, 32),        # capped by max_blocks_per_sm
        (256, 128, 0, 2),       # regs: 4096/warp -> 4 warps per sub-partition -> 16 warps/SM
        (256, 255, 0, 1),       # 255 regs round to 8192/warp -> 8 warps/SM
        (100, 40, 0, 12),       # 100 threads = 4 warps; 1280 regs/warp -> 12 warps per sub-partition -> 48
        (128, 32, 49152, 4),    # shared: 49152 + 1024 reserved per block -> 233472 // 50176 = 4
        (128, 32, 20000, 11),   # 20000 -> 20096 (128-byte units) + 1024 -> 233472 // 21120 = 11
    ],
)
def test_occupancy_matches_cuda_occupancy_rules(threads, regs, smem, blocks):
    assert H100.occupancy(threads, regs, smem) == blocks


def test_unknown_registers_assume_default():
    assert H100.occupancy(1024, None, 0) == 1
    assert VDevice(num_sms=1, default_registers=32).occupancy(1024, None, 0) == 2


@pytest.mark.parametrize(
    "args, match",
    [
        ((2048, 32, 0), "threads=2048"),
        ((1024, 255, 0), "registers"),
        ((128, 300, 0), "registers=300"),
        ((128, 32, 60000), "shared_bytes=60000"),
    ],
)
def test_occupancy_rejects_blocks_that_cannot_fit(args, match):
    with pytest.raises(ValueError, match=match):
        H100.occupancy(*args)


def test_shared_memory_limit_per_sm_names_shared_memory():
    small = VDevice(num_sms=1, smem_per_sm=32768, smem_per_block=49152)
    with pytest.raises(ValueError, match="shared memory"):
        small.occupancy(128, 32, 40000)


def test_veus_per_sm_uses_the_most_demanding_rtask():
    # 1024 threads from one kernel, 64 regs from another: 1 vEU/SM though each alone allows more.
    kernels = [kernel(1024, 32), kernel(128, 64), kernel(64, 16, shared=1000)]
    assert H100.veu_shape(kernels) == (1024, 64, 1000)
    assert H100.veus_per_sm(kernels) == 1
    assert H100.num_veus(kernels) == 132
    assert H100.veus_per_sm([kernel(256, 32)]) == 8
    assert H100.veus_per_sm([kernel(256, 32)], registers=128) == 2


def test_presets():
    assert VDevice.for_arch("sm_90").num_sms == 132
    assert VDevice.for_arch("sm_90a").num_sms == 132
    assert VDevice.for_arch("sm_80").num_sms == 108
    assert VDevice.for_arch("sm_86").num_sms == 84
    assert VDevice.for_arch("sm_89").num_sms == 128
    assert VDevice.for_arch("sm_100").num_sms == 148
    assert VDevice.for_arch("sm_86").max_threads_per_sm == 1536
    with pytest.raises(ValueError, match="no VDevice preset for arch 'sm_42'"):
        VDevice.for_arch("sm_42")


def test_from_tvm_device_reads_guarded_attributes():
    dev = SimpleNamespace(compute_version="8.0", multi_processor_count=100, max_shared_memory_per_block=49152)
    vdev = VDevice.from_tvm_device(dev)
    assert (vdev.num_sms, vdev.smem_per_sm, vdev.smem_per_block) == (100, 167936, 49152)
    assert VDevice.from_tvm_device(SimpleNamespace()).num_sms == 132


def test_bad_fields_are_rejected():
    with pytest.raises(ValueError, match="VDevice.num_sms must be >= 1, got 0"):
        VDevice(num_sms=0)
    with pytest.raises(TypeError, match="VDevice.warp_size must be an int"):
        VDevice(num_sms=1, warp_size=32.0)
