"""Communication lives in two places: ProcessGroup (cupytp/distributed) moves bytes and
redistribute decides when they move. Nothing else in the package calls a collective, but for
the ring of context parallelism (point-to-point steps no change of placement expresses), and
nothing outside cupytp/distributed (package, examples, benchmarks, tests) reaches MPI itself:
they use the runtime's helpers (barrier, broadcast_object, all_gather_object)."""
import re

from launch import REPO

COLLECTIVE_CALL = re.compile(r"\.(all_reduce|all_gather|reduce_scatter|broadcast|scatter|gather"
                             r"|all_to_all|send|recv|sendrecv)\(")
RAW_MPI = re.compile(r"mpi4py|\bMPI\.COMM_WORLD|world_comm\(|host_comm")
# the places that move data: the transition table, building a tensor from a source rank, and
# the ring attention of context parallelism
COMMUNICATES = {"cupytp/tensor/redistribute.py", "cupytp/tensor/factory.py",
                "cupytp/parallel/context.py"}


def sources(*folders):
    for folder in folders:
        for path in sorted((REPO / folder).rglob("*.py")):
            name = path.relative_to(REPO).as_posix()
            if not name.startswith("cupytp/distributed/") and name != \
                    "tests/unit/test_communication_homes.py":
                yield name, path.read_text(encoding="utf-8")


def offending(pattern, files):
    return [f"{name}:{number}: {line.strip()}" for name, text in files
            for number, line in enumerate(text.splitlines(), 1) if pattern.search(line)]


def test_only_process_groups_and_redistribute_call_collectives():
    files = [(name, text) for name, text in sources("cupytp") if name not in COMMUNICATES]
    assert offending(COLLECTIVE_CALL, files) == []


def test_nothing_outside_the_runtime_reaches_mpi():
    assert offending(RAW_MPI, sources("cupytp", "examples", "bench", "tests")) == []
