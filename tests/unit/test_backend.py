"""backend helpers against NumPy: copy_rows moves 2-D blocks of contiguous rows between arrays
of any row pitch (cudaMemcpy2DAsync on a GPU) and refuses what it cannot copy."""
import numpy
import pytest

from cupytp import backend


def test_copy_rows_copies_between_row_pitches():
    source = numpy.arange(4 * 10, dtype=numpy.float32).reshape(4, 10)
    rows = backend.asarray(source)
    full = backend.xp.zeros((4, 3), dtype=numpy.float32)
    backend.copy_rows(full, rows[:, 5:8])
    numpy.testing.assert_array_equal(backend.asnumpy(full), source[:, 5:8])
    wide = backend.xp.zeros((4, 7), dtype=numpy.float32)
    backend.copy_rows(wide[:, 2:5], full)
    expected = numpy.zeros((4, 7), numpy.float32)
    expected[:, 2:5] = source[:, 5:8]
    numpy.testing.assert_array_equal(backend.asnumpy(wide), expected)


def test_copy_rows_refuses_mismatched_arrays():
    a = backend.xp.zeros((2, 3), dtype=numpy.float32)
    with pytest.raises(ValueError, match="copy_rows"):
        backend.copy_rows(a, backend.xp.zeros((2, 3), dtype=numpy.float64))
    with pytest.raises(ValueError, match="copy_rows"):
        backend.copy_rows(a, backend.xp.zeros((3, 2), dtype=numpy.float32))
    if backend.on_gpu:
        with pytest.raises(ValueError, match="contiguous"):
            backend.copy_rows(a, backend.xp.zeros((2, 6), dtype=numpy.float32)[:, ::2])
