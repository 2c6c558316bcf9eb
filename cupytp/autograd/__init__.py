"""The tape: recorded ops (Nodes), backward(), no_grad()."""
from cupytp.autograd.engine import Node, backward, enable_grad, is_grad_enabled, no_grad, record

__all__ = ["Node", "backward", "enable_grad", "is_grad_enabled", "no_grad", "record"]
