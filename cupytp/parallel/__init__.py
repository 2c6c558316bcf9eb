"""Parallelization of whole models: tensor-parallel plans."""
from cupytp.parallel.tensor_parallel import (
    apply_tensor_parallel, megatron_plan, parallelize_module, relayout)

__all__ = ["apply_tensor_parallel", "megatron_plan", "parallelize_module", "relayout"]
