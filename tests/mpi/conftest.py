import shutil
import tempfile

import pytest

import cupytp
from cupytp.distributed.runtime import barrier, broadcast_object


@pytest.fixture(scope="session")
def world():
    """The Runtime of this job (1 rank under plain pytest, N under mpiexec -n N)."""
    return cupytp.init()


@pytest.fixture(scope="session")
def mesh1d(world):
    return cupytp.DeviceMesh((world.world_size,), ("tp",))


@pytest.fixture(scope="session")
def mesh2d(world):
    """A 2-D (dp, tp) mesh: (2, N/2) on an even world, else (1, N)."""
    n = world.world_size
    shape = (2, n // 2) if n % 2 == 0 else (1, n)
    return cupytp.DeviceMesh(shape, ("dp", "tp"))


@pytest.fixture(params=["1d", "2d"])
def mesh(request, mesh1d, mesh2d):
    return mesh1d if request.param == "1d" else mesh2d


@pytest.fixture
def shared_dir(world):
    """A fresh directory that every rank sees."""
    path = broadcast_object(tempfile.mkdtemp(prefix="cupytp-test-") if world.rank == 0 else None)
    yield path
    barrier()
    if world.rank == 0:
        shutil.rmtree(path)
