"""Launching a compiled kernel through the driver with its arguments in ready-made slots.

`Kernel(raw)` wraps a CuPy RawKernel; `kernel(grid, block, args, shared_mem=0)` launches it on
the current stream as `raw(grid, block, args, shared_mem=shared_mem)` would, for half the host
time: the arguments are written into `ArgumentSlots` (ctypes storage made once per signature of
argument types, with the array of their addresses that cuLaunchKernel reads) and the launch is
one driver call. Arguments: CuPy arrays (passed as their data pointers), NumPy scalars, Python
ints (int64), floats (double) and bools; a signature with anything else goes to CuPy's call.

`kernel.planned(grid, block, template, shared_mem=0)` fixes a launch's configuration and the
scalar arguments that do not change (the `template` leaves the others open): the returned
`PlannedLaunch`, called with the open arguments alone, writes them and launches (a launcher that
calls one shape again and again pays neither the other arguments' conversion nor the lookup of
their types).
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

    def planned(self, grid, block, template, shared_mem=0):
        """A `PlannedLaunch` of this kernel (module docstring)."""
        return PlannedLaunch(self, grid, block, template, shared_mem)


class PlannedLaunch:
    """One kernel's launch with its grid, block, shared memory and fixed scalars written once:
    `launch(*values)` fills the template's open slots, in order (None: a device array, or its
    address as an int; a scalar type such as numpy.uint64: a scalar of that type) and launches
    on the current stream."""
    __slots__ = ("kernel", "config", "slots", "open", "_lock")

    def __init__(self, kernel, grid, block, template, shared_mem):
        array_type = kernel._xp.ndarray
        types = tuple(array_type if arg is None else arg if isinstance(arg, type) else type(arg)
                      for arg in template)
        if not ArgumentSlots.supports(types, array_type):
            raise TypeError(f"a planned launch takes arrays and scalars of "
                            f"{sorted(map(str, _CTYPES))}, got {types}")
        self.kernel, self.slots, self._lock = kernel, ArgumentSlots(types, array_type), \
            threading.Lock()
        self.open = tuple((i, arg is None) for i, arg in enumerate(template)
                          if arg is None or isinstance(arg, type))
        for i in self.slots.scalars:
            if not isinstance(template[i], type):
                self.slots.values[i].value = template[i]
        self.config = (*as_three(grid), *as_three(block), shared_mem)

    def __call__(self, *values):
        kernel, slots = self.kernel, self.slots
        function = kernel._function or kernel._load()
        cuda = kernel._xp.cuda
        slot_values = slots.values
        with self._lock:
            for (i, is_array), value in zip(self.open, values):
                slot_values[i].value = value.data.ptr if is_array and type(value) is not int \
                    else value
            cuda.driver.launchKernel(function, *self.config, cuda.get_current_stream().ptr,
                                     slots.address, 0)


def as_three(dims):
    """A grid or block as (x, y, z): an int or a tuple of one to three ints."""
    if type(dims) is int:
        return dims, 1, 1
    if len(dims) == 3:
        return dims
    return (dims[0], 1, 1) if len(dims) == 1 else (dims[0], dims[1], 1)
