"""The tape: recorded ops (Nodes), backward() (whole, or split: DeferredBackward), no_grad()."""
from cupytp.autograd.engine import (
    DeferredBackward, Node, backward, enable_grad, is_grad_enabled, no_grad, record)

__all__ = ["DeferredBackward", "Node", "backward", "enable_grad", "is_grad_enabled", "no_grad",
           "record"]
