"""Pipeline schedule tables: every table of every schedule (1 to 8 ranks, 1 to 9 micro-batches,
2 and 3 stages per rank for interleaved 1F1B) runs to its end when each rank executes its list
with first-in first-out transfers (an executor written here, not the package's simulator), each
forward and backward once with its inputs there; its simulated bubble is within 10% of the
closed-form theory; memory stays within each schedule's bound; the printer draws the timeline;
bad tables and arguments are one clear error. The balanced split of blocks is the best one."""
import itertools

import pytest

from cupytp.parallel.pipeline import schedules
from cupytp.parallel.pipeline.schedules import (
    Action, Schedule, ScheduleError, format_schedule, make_schedule, theoretical_bubble)
from cupytp.parallel.pipeline.stages import split_layers

CASES = [(name, pp, m, v) for name in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b")
         for pp in (1, 2, 3, 4, 5, 8) for m in range(1, 10)
         for v in ((2, 3) if name == "interleaved_1f1b" else (1,))
         if name != "interleaved_1f1b" or m % max(1, m // pp) == 0]


def execute(schedule):
    """Run every rank's list in turn: a send queues its (kind, stage, micro-batch) for its
    peer, a receive takes the head of the queue from its peer and must get the transfer it
    names, a compute action must have its inputs (received, or made on this rank). Returns the
    order the compute actions ran in; fails on a stall."""
    pp, last = schedule.pp, schedule.stages - 1
    queues, have = {}, set()        # (from, to) -> transfers; (what, stage, micro-batch) held
    position = [0] * pp
    ran = []
    while any(position[r] < len(schedule.actions[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while position[r] < len(schedule.actions[r]):
                a = schedule.actions[r][position[r]]
                if a.kind in ("SEND_F", "SEND_B"):
                    to = (a.stage + (1 if a.kind == "SEND_F" else -1)) % pp
                    made = ("out" if a.kind == "SEND_F" else "dx", a.stage, a.microbatch)
                    assert made in have, f"rank {r} sends {a} before making it"
                    queues.setdefault((r, to), []).append((a.kind, a.stage, a.microbatch))
                elif a.kind in ("RECV_F", "RECV_B"):
                    source = (a.stage + (-1 if a.kind == "RECV_F" else 1)) % pp
                    queue = queues.get((source, r), [])
                    if not queue:
                        break
                    got = queue.pop(0)
                    want = ("SEND_F", a.stage - 1, a.microbatch) if a.kind == "RECV_F" else \
                        ("SEND_B", a.stage + 1, a.microbatch)
                    assert got == want, f"rank {r} expects {want}, the queue gives {got}"
                else:
                    s, k = a.stage, a.microbatch
                    if a.kind == "F":
                        assert s == 0 or ("out", s - 1, k) in have, f"{a} without its input"
                        have.add(("out", s, k))
                    elif a.kind in ("B", "I"):
                        assert ("out", s, k) in have
                        assert s == last or ("dx", s + 1, k) in have, f"{a} without its gradient"
                        have.add(("dx", s, k))
                        have.add(("dw", s, k) if a.kind == "B" else ("di", s, k))
                    else:
                        assert ("di", s, k) in have, f"{a} before its input-gradient part"
                        have.add(("dw", s, k))
                    ran.append(a)
                position[r] += 1
                moved = True
        assert moved, f"{schedule!r} stalls at {position}"
    assert not any(queues.values()), "transfers nobody received"
    return ran


@pytest.mark.parametrize("name,pp,m,v", CASES)
def test_every_table_runs_and_every_step_has_its_inputs(name, pp, m, v):
    schedule = make_schedule(name, pp, m, v)
    ran = execute(schedule)
    split = name == "zb_h1"
    kinds = ("F", "I", "W") if split else ("F", "B")
    expected = {(kind, s, k) for kind in kinds for s in range(pp * v) for k in range(m)}
    assert sorted((a.kind, a.stage, a.microbatch) for a in ran) == sorted(expected)
    simulated, theory = schedule.timeline.bubble, theoretical_bubble(name, pp, m, v)
    assert abs(simulated - theory) <= 0.1 * theory + 1e-12, (simulated, theory)


@pytest.mark.parametrize("pp,m", list(itertools.product((2, 4), (1, 2, 4, 8))))
def test_the_bubbles_of_the_matrix(pp, m):
    """The brief's matrix, by hand: GPipe and 1F1B (p-1)/(m+p-1) exactly; ZB-H1 a third of
    that idle time once m >= p; interleaved 1F1B with 2 stages per rank (p-1)/(2m+p-1) once
    m >= p."""
    one = make_schedule("1f1b", pp, m).timeline.bubble
    assert one == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    assert make_schedule("gpipe", pp, m).timeline.bubble == pytest.approx(one, abs=1e-12)
    if m >= pp:
        zb = make_schedule("zb_h1", pp, m).timeline
        assert zb.span == 3 * m + pp - 1                  # 1F1B: 3m + 3(p-1) ticks
        assert make_schedule("interleaved_1f1b", pp, m).timeline.bubble == \
            pytest.approx((pp - 1) / (2 * m + pp - 1), abs=1e-12)


def in_flight(actions, release):
    """The most micro-batches whose activations a rank holds at once (from a forward until
    the action `release`)."""
    held, most = 0, 0
    for a in actions:
        held += (a.kind == "F") - (a.kind == release)
        most = max(most, held)
    return most


def test_memory_bounds():
    """GPipe holds every micro-batch; 1F1B at most pp - r on rank r; ZB-H1 at most pp on every
    rank (1F1B's first rank's peak), its W's holding them."""
    pp, m = 4, 8
    gpipe, one, zb = (make_schedule(n, pp, m) for n in ("gpipe", "1f1b", "zb_h1"))
    for r in range(pp):
        assert in_flight(gpipe.actions[r], "B") == m
        assert in_flight(one.actions[r], "B") == pp - r
        assert in_flight(zb.actions[r], "W") == pp


def test_printer_draws_each_rank_at_each_tick():
    assert str(make_schedule("1f1b", 2, 2)) == "\n".join([
        "1f1b: pp=2, 2 micro-batches; bubble 33.3% (theory 33.3%)",
        "rank 0  0F0 0F1 .   .   0B0 0B0 .   0B1 0B1",
        "rank 1  .   1F0 1B0 1B0 1F1 1B1 1B1 .   ."])
    lines = format_schedule(make_schedule("zb_h1", 2, 2)).splitlines()
    assert lines[1] == "rank 0  0F0 0F1 .   0I0 0W0 0I1 0W1"
    assert lines[2] == "rank 1  .   1F0 1I0 1F1 1I1 1W0 1W1"


def test_tables_list_their_transfers():
    """A rank sends right after making a tensor and receives before needing it, batched
    between compute actions: 1F1B's steady state sends one way and receives the other at once
    (Megatron's send_forward_recv_backward)."""
    actions = [str(a) for a in make_schedule("1f1b", 2, 3).actions[0]]
    assert actions == ["0F0", "0SEND_F0", "0F1", "0SEND_F1", "0RECV_B0", "0B0", "0F2",
                       "0SEND_F2", "0RECV_B1", "0B1", "0RECV_B2", "0B2"]


def test_a_table_that_would_wait_forever_is_refused():
    f, b = Action("F", 0, 0), Action("B", 0, 0)
    deadlock = [[f, Action("RECV_B", 0, 0), b, Action("SEND_F", 0, 0)],
                [Action("RECV_F", 1, 0), Action("F", 1, 0), Action("B", 1, 0),
                 Action("SEND_B", 1, 0)]]
    with pytest.raises(ScheduleError, match="deadlocks: rank 0 at 0RECV_B0; rank 1 at 1RECV_F0"):
        Schedule("bad", 2, 1, 1, deadlock)
    with pytest.raises(ScheduleError, match="lacks"):
        Schedule("bad", 1, 1, 1, [[f]])
    with pytest.raises(ScheduleError, match="twice"):
        Schedule("bad", 1, 1, 1, [[f, f, b]])


@pytest.mark.parametrize("args,message", [
    (("pipedream", 2, 4), "unknown pipeline schedule 'pipedream'"),
    (("1f1b", 2, 4, 2), "virtual_stages=2 needs interleaved_1f1b"),
    (("interleaved_1f1b", 2, 4, 1), "needs virtual_stages >= 2"),
    (("interleaved_1f1b", 4, 9, 2), "do not split into 2 equal rounds"),
    (("1f1b", 0, 4), "pp must be a positive integer"),
    (("gpipe", 2, 0), "microbatches must be a positive integer"),
])
def test_bad_arguments(args, message):
    with pytest.raises(ScheduleError, match=message):
        make_schedule(*args)


def test_balanced_split_is_the_best_contiguous_one():
    """Against every contiguous split: the largest stage cost (the first stage adding the
    embeddings, the last the head) is the least possible; middle stages hold a block."""
    costs = [5, 1, 7, 3, 3, 8, 2, 6]
    for stages, first, last in ((2, 0, 0), (3, 10, 4), (4, 3, 12), (5, 0, 9)):
        bounds = split_layers(costs, stages, first, last)
        assert bounds[0][0] == 0 and bounds[-1][1] == len(costs)

        def worst(cuts):
            edges = [0, *cuts, len(costs)]
            return max(sum(costs[a:b]) + (first if i == 0 else 0) +
                       (last if i == stages - 1 else 0)
                       for i, (a, b) in enumerate(zip(edges, edges[1:])))
        options = [c for c in itertools.combinations_with_replacement(range(len(costs) + 1),
                                                                      stages - 1)
                   if all(c[i] < c[i + 1] for i in range(len(c) - 1))]
        assert worst([b for _, b in bounds[:-1]]) == min(worst(c) for c in options)
    assert split_layers(costs, 3, layers=[2, 3, 3]) == [(0, 2), (2, 5), (5, 8)]
    with pytest.raises(ValueError, match="give 3 block counts"):
        split_layers(costs, 3, layers=[2, 3])
    with pytest.raises(ValueError, match="cannot fill 12 pipeline stages"):
        split_layers(costs, 12)


def test_lowering_keeps_each_pair_in_order():
    """Interleaved tables send both ways between ranks; each receiver takes its peer's
    transfers in the order they are sent, checked by the package too."""
    for pp, m, v in ((2, 4, 2), (4, 8, 3), (3, 6, 2)):
        schedule = make_schedule("interleaved_1f1b", pp, m, v)
        schedules._check_fifo(schedule)
        execute(schedule)
