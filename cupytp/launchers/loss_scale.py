"""Dynamic loss scaling's update: `loss_scale.cu` for CuPy arrays, a NumPy twin otherwise.

`update_loss_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval)`
updates in place a float32 scale and an int32 growth tracker (one element each) from a float32
found_inf flag (one element): on a non-finite step the scale backs off and the tracker restarts;
after `growth_interval` finite steps in a row the scale grows (only to a finite value).
"""
import numpy

from cupytp.launchers import get_kernel, is_device_array


def _check(scale, tracker, found_inf):
    for name, array, dtype in (("scale", scale, numpy.float32), ("tracker", tracker, numpy.int32),
                               ("found_inf", found_inf, numpy.float32)):
        if array.dtype != dtype or array.size != 1:
            raise ValueError(f"update_loss_scale: {name} must be a {numpy.dtype(dtype)} array of "
                             f"one element, got {array.dtype} {array.shape}")


def update_loss_scale(scale, tracker, found_inf, growth_factor, backoff_factor, growth_interval):
    _check(scale, tracker, found_inf)
    if not is_device_array(scale):
        update_loss_scale_numpy(scale, tracker, found_inf, growth_factor, backoff_factor,
                                growth_interval)
        return
    get_kernel("loss_scale.cu", "update_loss_scale")(
        (1,), (1,), (scale, tracker, found_inf, numpy.float32(growth_factor),
                     numpy.float32(backoff_factor), numpy.int32(growth_interval)))


def update_loss_scale_numpy(scale, tracker, found_inf, growth_factor, backoff_factor,
                            growth_interval):
    """NumPy twin of `update_loss_scale`."""
    _check(scale, tracker, found_inf)
    if found_inf.reshape(()) != 0:
        scale[...] = scale * numpy.float32(backoff_factor)
        tracker[...] = 0
        return
    successful = int(tracker.reshape(())) + 1
    if successful == growth_interval:
        with numpy.errstate(over="ignore"):
            grown = scale * numpy.float32(growth_factor)
        if numpy.isfinite(grown).all():
            scale[...] = grown
        tracker[...] = 0
    else:
        tracker[...] = successful
