"""Kernel-level Rammer machinery: lower one scheduled kernel, instantiate its rTasks in a vEU."""
from .prelower import LoweredKernel, UnsupportedKernel, prelower
from .rtask_rewrite import instantiate

__all__ = ["LoweredKernel", "UnsupportedKernel", "prelower", "instantiate"]
