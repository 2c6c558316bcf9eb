"""Launching a compiled kernel through the driver with its arguments in ready-made slots.

`Kernel(raw)` wraps a CuPy RawKernel; `kernel(grid, block, args, shared_mem=0)` launches it on
the current stream as `raw(grid, block, args, shared_mem=shared_mem)` would, for half the host
time: the arguments are written into `ArgumentSlots` (ctypes storage made once per signature of
argument types, with the array of their addresses that cuLaunchKernel reads) and the launch is
one driver call. Arguments: CuPy arrays (passed as their data pointers), NumPy scalars, Python
ints (int64), floats (double) and bools; a signature with anything else goes to CuPy's call.
"""
import ctypes
import threading

import numpy

_CTYPES = {numpy.int8: ctypes.c_int8, numpy.uint8: ctypes.c_uint8, numpy.int16: ctypes.c_int16,
           numpy.uint16: ctypes.c_uint16, numpy.int32: ctypes.c_int32,
           numpy.uint32: ctypes.c_uint32, numpy.int64: ctypes.c_int64,
           numpy.uint64: ctypes.c_uint64, numpy.float32: ctypes.c_float,
           numpy.float64: ctypes.c_double, numpy.bool_: ctypes.c_bool, int: ctypes.c_int64,
           float: ctypes.c_double, bool: ctypes.c_bool}


class ArgumentSlots:
    """Storage for the arguments of one signature (a tuple of argument types, `array_type` for
    device arrays): a ctypes value per argument and `address`, that of the void* array pointing
    at them (cuLaunchKernel's kernelParams). `fill(args)` writes a call's arguments."""
    __slots__ = ("values", "arrays", "scalars", "pointers", "address")

    def __init__(self, types, array_type):
        self.values = [ctypes.c_uint64() if kind is array_type else _CTYPES[kind]()
                       for kind in types]
        self.arrays = tuple(i for i, kind in enumerate(types) if kind is array_type)
        self.scalars = tuple(i for i, kind in enumerate(types) if kind is not array_type)
        self.pointers = (ctypes.c_void_p * max(1, len(types)))(
            *[ctypes.addressof(value) for value in self.values])
        self.address = ctypes.addressof(self.pointers)

    @staticmethod
    def supports(types, array_type):
        return all(kind is array_type or kind in _CTYPES for kind in types)

    def fill(self, args):
        values = self.values
        for i in self.arrays:
            values[i].value = args[i].data.ptr
        for i in self.scalars:
            values[i].value = args[i]


class Kernel:
    """A compiled kernel (CuPy's RawKernel `raw`) launched through the driver (module
    docstring). Slots are shared by the launches of one signature, under a lock: the driver
    copies the arguments before cuLaunchKernel returns."""
    __slots__ = ("raw", "_slots", "_lock", "_xp", "_function")

    def __init__(self, raw, xp):
        self.raw, self._slots, self._lock, self._xp = raw, {}, threading.Lock(), xp
        self._function = None           # the CUfunction, loaded at the first launch

    def __call__(self, grid, block, args, shared_mem=0):
        types = tuple(map(type, args))
        slots = self._slots.get(types)
        if slots is None:
            slots = self._slots[types] = ArgumentSlots(types, self._xp.ndarray) \
                if ArgumentSlots.supports(types, self._xp.ndarray) else False
        if not slots:
            return self.raw(grid, block, args, shared_mem=shared_mem)
        function = self._function or self._load()
        gx, gy, gz = as_three(grid)
        bx, by, bz = as_three(block)
        cuda = self._xp.cuda
        with self._lock:
            slots.fill(args)
            cuda.driver.launchKernel(function, gx, gy, gz, bx, by, bz, shared_mem,
                                     cuda.get_current_stream().ptr, slots.address, 0)

    def _load(self):
        self._function = self.raw.kernel.ptr
        return self._function


def as_three(dims):
    """A grid or block as (x, y, z): an int or a tuple of one to three ints."""
    if type(dims) is int:
        return dims, 1, 1
    if len(dims) == 3:
        return dims
    return (dims[0], 1, 1) if len(dims) == 1 else (dims[0], dims[1], 1)
