"""DTensor's operators and math methods, attached to the class by the ops package.

The tensor layer sits below the ops, so `DTensor` itself defines only data, layout and autograd
methods; importing `cupytp.ops` (which `import cupytp` does) gives it `+ - * / ** @ [...]` and
`sum`, `reshape`, `transpose`, `astype`, ... as thin calls of the ops.
"""
import numbers

from cupytp.ops import elementwise, linalg, reduction, shape
from cupytp.tensor.dtensor import DTensor


def _pow(x, exponent):
    if not isinstance(exponent, numbers.Number):
        raise TypeError("a DTensor's power takes a Python number exponent")
    return elementwise.pow(x, exponent)


def _shape_args(args):
    """`f(2, 3)` or `f((2, 3))`: the tuple either way."""
    return args[0] if len(args) == 1 and not isinstance(args[0], int) else args


def _reshape(x, *shape_):
    return shape.reshape(x, _shape_args(shape_))


METHODS = {
    "__add__": elementwise.add,
    "__radd__": lambda x, other: elementwise.add(other, x),
    "__sub__": elementwise.sub,
    "__rsub__": lambda x, other: elementwise.sub(other, x),
    "__mul__": elementwise.mul,
    "__rmul__": lambda x, other: elementwise.mul(other, x),
    "__truediv__": elementwise.div,
    "__rtruediv__": lambda x, other: elementwise.div(other, x),
    "__neg__": elementwise.neg,
    "__pow__": _pow,
    "__matmul__": linalg.matmul,
    "__rmatmul__": lambda x, other: linalg.matmul(other, x),
    "__getitem__": shape.getitem,
    "sum": reduction.sum,
    "mean": reduction.mean,
    "max": reduction.max,
    "sum_to_shape": reduction.sum_to_shape,
    "exp": elementwise.exp,
    "log": elementwise.log,
    "sqrt": elementwise.sqrt,
    "tanh": elementwise.tanh,
    "astype": elementwise.astype,
    "to": elementwise.astype,
    "reshape": _reshape,
    "view": _reshape,
    "transpose": shape.transpose,
    "permute": lambda x, *dims: shape.permute(x, _shape_args(dims)),
    "T": property(lambda x: shape.transpose(x, -2, -1)),
}

for _name, _method in METHODS.items():
    setattr(DTensor, _name, _method)
