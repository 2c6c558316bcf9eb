"""Seeing what a distributed program does: the collectives it issues (CommTracer) and where a
tensor's blocks live (visualize_sharding). CUPYTP_DEBUG=1 adds checks: see cupytp.distributed."""
from cupytp.debug.comm_tracer import CommTracer
from cupytp.debug.sharding import visualize_sharding

__all__ = ["CommTracer", "visualize_sharding"]
