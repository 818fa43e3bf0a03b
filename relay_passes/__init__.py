"""Relax graph passes of tvm-rammer: the dataflow graph of `main` and branch-preserving fusion."""
from .branch_fusion import BranchPreservingFusion, plan_groups
from .dataflow_graph import DataflowGraph, Node, TensorRef, has_block_binding

__all__ = ["BranchPreservingFusion", "DataflowGraph", "Node", "TensorRef", "has_block_binding", "plan_groups"]
