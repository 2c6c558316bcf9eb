"""Pipeline schedules as data: for every rank of the pipeline, the list of actions it runs, in
order. A new schedule is a new table; the runtime that executes tables does not change.

An `Action` is (kind, stage, micro-batch), printed like torch.distributed.pipelining's `0F1`
(stage 0, forward of micro-batch 1):

    F  forward                      SEND_F  the stage's output to the next stage's rank
    B  backward (input and weights) RECV_F  the stage's input from the previous stage's rank
    I  backward, input gradient     SEND_B  the stage's input gradient to the previous rank
    W  backward, weight gradients   RECV_B  the stage's output gradient from the next rank

Stages are numbered 0..S-1 along the model; with v virtual stages per rank (interleaved
schedules) stage s runs on rank s % pp, so each rank holds v chunks of layers, pp stages apart.
A generator decides only the order of the compute actions on each rank; `lower` inserts the
communication. Each transfer is keyed by the tick at which its tensor is made in the ideal
timeline (a forward one tick, a backward two, transfers free), and every rank runs its compute
actions and transfers in the order of those ticks, transfers first at a tie: a send right
after the action that made its tensor, a receive no later than the action that needs it, and
the transfers of all ranks in one global order, so those between two ranks are matched
first-in first-out (as MPI and NCCL match them) and no table waits for itself (docs/design.md).
The communication actions between two compute actions form one batch (`batch_isend_irecv`:
one NCCL group).

`simulate` runs a table with a cost per compute action (ticks): sends never wait, a receive
waits for its send. With `blocking=True` a batch also waits until the peer has posted the other
side of each of its transfers, as NCCL's grouped sends and receives do; a table that cannot
finish that way would deadlock on GPUs, and `Schedule` refuses it when made.
"""
import dataclasses

FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT = "F", "B", "I", "W"
SEND_F, RECV_F, SEND_B, RECV_B = "SEND_F", "RECV_F", "SEND_B", "RECV_B"
COMPUTE = (FORWARD, BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT)
COSTS = {FORWARD: 1, BACKWARD: 2, BACKWARD_INPUT: 1, BACKWARD_WEIGHT: 1}   # ticks


class ScheduleError(ValueError):
    """A schedule that cannot run: bad sizes, or a table that would deadlock."""


@dataclasses.dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: `kind` (F, B, I, W or a send/receive), the stage (0..S-1
    along the model) and the micro-batch."""
    kind: str
    stage: int
    microbatch: int

    def __str__(self):
        return f"{self.stage}{self.kind}{self.microbatch}"

    @property
    def is_compute(self):
        return self.kind in COMPUTE


@dataclasses.dataclass(frozen=True)
class Timeline:
    """What `simulate` found: per rank, (start tick, action) of each compute action, its busy
    ticks, and the tick at which the last rank ends (`span`)."""
    starts: tuple
    busy: tuple
    span: int

    @property
    def bubble(self):
        """The idle fraction of all ranks' ticks up to the span."""
        return 1.0 - sum(self.busy) / (len(self.busy) * self.span) if self.span else 0.0


class Schedule:
    """A pipeline schedule: `actions[r]` is rank r's list of Actions (compute and
    communication); `name`, `pp` (ranks), `virtual_stages` (stages per rank), `microbatches`.
    Made by `make_schedule`, or from compute orders by `Schedule.from_compute`."""

    def __init__(self, name, pp, virtual_stages, microbatches, actions):
        self.name, self.pp, self.virtual_stages = name, pp, virtual_stages
        self.microbatches = microbatches
        self.stages = pp * virtual_stages
        self.actions = tuple(tuple(rank) for rank in actions)
        self._check()
        self.timeline = simulate(self)
        simulate(self, blocking=True)

    @classmethod
    def from_compute(cls, name, pp, virtual_stages, microbatches, compute):
        """The schedule whose ranks run the compute actions `compute[r]` in that order, with
        the communication `lower` inserts."""
        return cls(name, pp, virtual_stages, microbatches,
                   lower(compute, pp, pp * virtual_stages))

    def rank_of(self, stage):
        """The rank that runs `stage`."""
        return stage % self.pp

    def stages_of(self, rank):
        """The stages rank `rank` runs, in model order."""
        return list(range(rank, self.stages, self.pp))

    @property
    def splits_backward(self):
        """True when the backward runs as I and W actions."""
        return any(a.kind == BACKWARD_INPUT for rank in self.actions for a in rank)

    def theoretical_bubble(self):
        """The idle fraction this kind of schedule has in theory, with a forward taking one
        tick, a backward two (input and weight gradients one each): see `theoretical_bubble`."""
        return theoretical_bubble(self.name, self.pp, self.microbatches, self.virtual_stages)

    def __str__(self):
        return format_schedule(self)

    def __repr__(self):
        return (f"Schedule({self.name!r}, pp={self.pp}, virtual_stages={self.virtual_stages}, "
                f"microbatches={self.microbatches})")

    # ---- checks ---------------------------------------------------------------------------------
    def _check(self):
        """Every stage runs F and its backward for every micro-batch once, on its own rank, and
        the transfers between each pair of ranks match in order (the constructor then runs the
        table, with sends that never wait and with NCCL's grouped sends and receives)."""
        if len(self.actions) != self.pp:
            raise ScheduleError(f"{self.name}: {len(self.actions)} rank lists for pp={self.pp}")
        split = self.splits_backward
        wanted = {FORWARD, BACKWARD_INPUT, BACKWARD_WEIGHT} if split else {FORWARD, BACKWARD}
        for rank, actions in enumerate(self.actions):
            seen = set()
            for a in actions:
                if self.rank_of(a.stage) != rank or not 0 <= a.microbatch < self.microbatches:
                    raise ScheduleError(f"{self.name}: rank {rank} runs {a}, which belongs to "
                                        f"rank {self.rank_of(a.stage)} or no micro-batch")
                if a.is_compute:
                    if (a.kind, a.stage, a.microbatch) in seen:
                        raise ScheduleError(f"{self.name}: rank {rank} runs {a} twice")
                    seen.add((a.kind, a.stage, a.microbatch))
            expected = {(k, s, m) for k in wanted for s in self.stages_of(rank)
                        for m in range(self.microbatches)}
            if seen != expected:
                missing = sorted(expected - seen)[:3]
                raise ScheduleError(f"{self.name}: rank {rank} lacks {missing} or runs actions "
                                    "of another kind of backward")
        _check_fifo(self)


# ---- communication -------------------------------------------------------------------------------
def _message(action, stages):
    """(kind of transfer, producing stage, consuming stage) of a compute action's output that
    leaves it, or None: a forward sends to the next stage, a backward's input gradient to the
    previous one."""
    if action.kind == FORWARD and action.stage < stages - 1:
        return SEND_F, action.stage, action.stage + 1
    if action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage > 0:
        return SEND_B, action.stage, action.stage - 1
    return None


def lower(compute, pp, stages):
    """Per rank, `compute[r]` with the sends and receives inserted (module docstring)."""
    naive = [_with_transfers(actions, rank, pp, stages) for rank, actions in enumerate(compute)]
    timed, _, _, sent = _run(naive, pp, COSTS, "the compute orders")   # ideal ticks
    lowered = []
    for rank, actions in enumerate(naive):
        starts = iter(start for start, _ in timed[rank])
        keyed = []
        for index, action in enumerate(actions):
            if action.is_compute:
                keyed.append(((next(starts), 1, index), action))
            else:
                transfer = _send_of(action) if action.kind in (RECV_F, RECV_B) else \
                    (action.kind, action.stage, action.microbatch)
                sender = transfer[1] % pp
                keyed.append(((sent[transfer], 0, sender, transfer), action))
        lowered.append([action for _, action in sorted(keyed, key=lambda item: item[0])])
    return lowered


def _with_transfers(actions, rank, pp, stages):
    """A rank's compute actions with each receive just before the action that needs it and
    each send just after the action that made its tensor (the order only times them)."""
    out = []
    for action in actions:
        if action.kind == FORWARD and action.stage > 0 and (action.stage - 1) % pp != rank:
            out.append(Action(RECV_F, action.stage, action.microbatch))
        if action.kind in (BACKWARD, BACKWARD_INPUT) and action.stage < stages - 1 and \
                (action.stage + 1) % pp != rank:
            out.append(Action(RECV_B, action.stage, action.microbatch))
        out.append(action)
        message = _message(action, stages)
        if message is not None and message[2] % pp != rank:
            out.append(Action(message[0], message[1], action.microbatch))
    return out


def _send_of(receive):
    """The (kind, stage, micro-batch) of the send a receive meets."""
    if receive.kind == RECV_F:
        return SEND_F, receive.stage - 1, receive.microbatch
    return SEND_B, receive.stage + 1, receive.microbatch


def peer_of(action, pp):
    """The rank on the other side of a send or receive: the next stage's for a forward's send
    and a backward's receive, the previous stage's for the others."""
    return (action.stage + (1 if action.kind in (SEND_F, RECV_B) else -1)) % pp


def _check_fifo(schedule):
    """Between each pair of ranks the receiver takes the transfers in the order they are sent."""
    sent, received = {}, {}
    for rank, actions in enumerate(schedule.actions):
        for a in actions:
            if a.kind in (SEND_F, SEND_B):
                sent.setdefault((rank, peer_of(a, schedule.pp)), []).append(
                    (a.kind, a.stage, a.microbatch))
            elif a.kind in (RECV_F, RECV_B):
                received.setdefault((peer_of(a, schedule.pp), rank), []).append(_send_of(a))
    for pair in set(sent) | set(received):
        if sent.get(pair, []) != received.get(pair, []):
            raise ScheduleError(f"{schedule.name}: rank {pair[1]} receives from rank {pair[0]} "
                                "in another order than it sends")


# ---- simulation ----------------------------------------------------------------------------------
def simulate(schedule, costs=COSTS, blocking=False):
    """Run `schedule` on ticks (compute actions cost `costs[kind]`, communication nothing) and
    return its Timeline. `blocking`: a batch of sends and receives also waits until every
    peer has posted its side (NCCL). A table that cannot finish is a ScheduleError naming
    where each rank waits."""
    starts, busy, clock, _ = _run(schedule.actions, schedule.pp, costs, schedule.name, blocking)
    return Timeline(tuple(tuple(s) for s in starts), tuple(busy), max(clock))


def _run(actions, pp, costs, name, blocking=False):
    """simulate() on per-rank action lists: (per rank [(start, compute action)], busy ticks,
    end ticks, {(send kind, stage, micro-batch): tick sent})."""
    batches = [_batches(rank) for rank in actions]
    position = [0] * pp
    clock = [0] * pp
    busy = [0] * pp
    starts = [[] for _ in range(pp)]
    arrived = {}                 # (kind, stage, micro-batch) of a send -> tick it was sent
    posted = set()               # (rank, batch index) and (rank, action) posted
    done = sum(1 for rank in batches if not rank)
    while done < pp:
        progressed = False
        for rank in range(pp):
            while position[rank] < len(batches[rank]):
                batch = batches[rank][position[rank]]
                if isinstance(batch, Action):        # a compute action
                    starts[rank].append((clock[rank], batch))
                    clock[rank] += costs[batch.kind]
                    busy[rank] += costs[batch.kind]
                else:
                    if (rank, position[rank]) not in posted:     # post the batch once
                        posted.add((rank, position[rank]))
                        posted.update((rank, a) for a in batch)
                        arrived.update(((a.kind, a.stage, a.microbatch), clock[rank])
                                       for a in batch if a.kind in (SEND_F, SEND_B))
                    if blocking and not all(_other_side(a, pp) in posted for a in batch):
                        break
                    receives = [_send_of(a) for a in batch if a.kind in (RECV_F, RECV_B)]
                    if any(r not in arrived for r in receives):
                        break
                    clock[rank] = max([clock[rank]] + [arrived[r] for r in receives])
                position[rank] += 1
                progressed = True
                if position[rank] == len(batches[rank]):
                    done += 1
        if not progressed and done < pp:
            waiting = "; ".join(f"rank {r} at {' '.join(map(str, batches[r][position[r]]))}"
                                for r in range(pp) if position[r] < len(batches[r]))
            raise ScheduleError(f"{name} deadlocks{' with NCCL' if blocking else ''}: "
                                f"{waiting}")
    return starts, busy, clock, arrived


def _batches(actions):
    """The actions as compute actions and lists of consecutive communication actions."""
    out = []
    for action in actions:
        if action.is_compute:
            out.append(action)
        elif out and isinstance(out[-1], list):
            out[-1].append(action)
        else:
            out.append([action])
    return out


def _other_side(action, pp):
    """(rank, action) of the transfer's other side."""
    kind, stage, microbatch = _send_of(action) if action.kind in (RECV_F, RECV_B) else \
        ({SEND_F: RECV_F, SEND_B: RECV_B}[action.kind],
         action.stage + 1 if action.kind == SEND_F else action.stage - 1, action.microbatch)
    return peer_of(action, pp), Action(kind, stage, microbatch)


# ---- generators ----------------------------------------------------------------------------------
def gpipe(pp, microbatches):
    """GPipe: every forward, then every backward (all-forward-all-backward)."""
    return [[Action(kind, r, k) for kind in (FORWARD, BACKWARD) for k in range(microbatches)]
            for r in range(pp)]


def one_f_one_b(pp, microbatches):
    """1F1B: rank r runs pp - r - 1 forwards, then alternates one forward and one backward,
    so at most pp - r micro-batches' activations are alive on it."""
    compute = []
    for r in range(pp):
        warmup = min(pp - r - 1, microbatches)
        actions = [Action(FORWARD, r, k) for k in range(warmup)]
        for k in range(microbatches - warmup):
            actions += [Action(FORWARD, r, warmup + k), Action(BACKWARD, r, k)]
        actions += [Action(BACKWARD, r, k) for k in range(microbatches - warmup, microbatches)]
        compute.append(actions)
    return compute


def interleaved_1f1b(pp, microbatches, virtual_stages):
    """Interleaved 1F1B (Megatron): v chunks per rank; the micro-batches go through the chunks
    in rounds of g (g = m / max(1, m // pp), at least pp when there are that many), forwards
    chunk after chunk, backwards in the reverse chunk order; rank r warms up with
    2 (pp - r - 1) + (v - 1) g forwards, then alternates a forward and a backward."""
    rounds = max(1, microbatches // pp)
    if microbatches % rounds:
        raise ScheduleError(f"interleaved_1f1b runs micro-batches in rounds of at least pp: "
                            f"{microbatches} micro-batches do not split into {rounds} equal "
                            f"rounds (pp={pp}); use a multiple of {rounds}, or fewer than "
                            f"{2 * pp}")
    group = microbatches // rounds
    order = [(k, chunk) for first in range(0, microbatches, group)
             for chunk in range(virtual_stages) for k in range(first, first + group)]
    compute = []
    for r in range(pp):
        forwards = [Action(FORWARD, r + chunk * pp, k) for k, chunk in order]
        backwards = [Action(BACKWARD, r + (virtual_stages - 1 - chunk) * pp, k)
                     for k, chunk in order]
        warmup = min(2 * (pp - r - 1) + (virtual_stages - 1) * group, len(order))
        actions = forwards[:warmup]
        for i in range(len(order) - warmup):
            actions += [forwards[warmup + i], backwards[i]]
        compute.append(actions + backwards[len(order) - warmup:])
    return compute


def zero_bubble_h1(pp, microbatches):
    """ZB-H1 (Qi et al., 2023): 1F1B's order with each backward split into its input-gradient
    part I, on the critical path, and its weight-gradient part W, which fills the idle time:
    rank r runs W of micro-batch k right after I of micro-batch k + r (the last r at the end),
    so at most pp micro-batches hold activations on any rank, as on 1F1B's first rank."""
    compute = []
    for r in range(pp):
        actions, weights = [], 0
        for action in one_f_one_b(pp, microbatches)[r]:
            if action.kind == FORWARD:
                actions.append(action)
                continue
            actions.append(Action(BACKWARD_INPUT, r, action.microbatch))
            if action.microbatch >= r:
                actions.append(Action(BACKWARD_WEIGHT, r, weights))
                weights += 1
        compute.append(actions + [Action(BACKWARD_WEIGHT, r, k)
                                  for k in range(weights, microbatches)])
    return compute


GENERATORS = {
    "gpipe": lambda pp, m, v: gpipe(pp, m),
    "1f1b": lambda pp, m, v: one_f_one_b(pp, m),
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": lambda pp, m, v: zero_bubble_h1(pp, m),
}
VIRTUAL = {"gpipe": False, "1f1b": False, "interleaved_1f1b": True, "zb_h1": False}


def make_schedule(name, pp, microbatches, virtual_stages=None):
    """The Schedule `name` ("gpipe", "1f1b", "interleaved_1f1b", "zb_h1") for `pp` ranks and
    `microbatches` micro-batches; `virtual_stages` (stages per rank) only for interleaved_1f1b
    (default 2)."""
    if name not in GENERATORS:
        raise ScheduleError(f"unknown pipeline schedule {name!r}: choose one of "
                            f"{', '.join(GENERATORS)}")
    if VIRTUAL[name]:
        virtual_stages = 2 if virtual_stages is None else virtual_stages
        if virtual_stages < 2:
            raise ScheduleError(f"{name} needs virtual_stages >= 2 (with 1 it is 1f1b)")
    elif virtual_stages not in (None, 1):
        raise ScheduleError(f"{name} runs one stage per rank: virtual_stages={virtual_stages} "
                            "needs interleaved_1f1b")
    virtual_stages = virtual_stages or 1
    for what, value in (("pp", pp), ("microbatches", microbatches)):
        if not isinstance(value, int) or value < 1:
            raise ScheduleError(f"{what} must be a positive integer, got {value!r}")
    compute = GENERATORS[name](pp, microbatches, virtual_stages)
    return Schedule.from_compute(name, pp, virtual_stages, microbatches, compute)


def theoretical_bubble(name, pp, microbatches, virtual_stages=1):
    """The idle fraction of the ranks' time in theory, a forward taking one tick and a
    backward two (one for the input gradient, one for the weights'): (p-1)/(m+p-1) for GPipe
    and 1F1B; for interleaved 1F1B with v stages per rank (p-1)/(vm+p-1), and with fewer
    micro-batches than ranks (v(p-m)+m-1)/(vp+m-1) (each chunk waits for the micro-batches to
    come round); for ZB-H1 (p-1)/(3m+p-1), a third of 1F1B's idle time, and with m < p the
    chain of forwards and input gradients through every rank bounds a step to 2(m+p)-1 ticks:
    1 - 3m/(2(m+p)-1)."""
    p, m, v = pp, microbatches, virtual_stages
    if name in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if name == "interleaved_1f1b":
        if m < p:
            return (v * (p - m) + m - 1) / (v * p + m - 1)
        return (p - 1) / (v * m + p - 1)
    if name == "zb_h1":
        return 1 - 3 * m / (3 * m + p - 1 + max(0, p - m))
    raise ScheduleError(f"no theory for schedule {name!r}")


# ---- printing ------------------------------------------------------------------------------------
def format_schedule(schedule, timeline=None, width=None):
    """The schedule as a grid: one row per rank, one column per tick, each cell the compute
    action that rank runs then (`.` idle; an action of several ticks repeats), after a line
    with its bubble (simulated and in theory). `timeline`: a measured Timeline to draw
    instead of the simulated one."""
    timeline = timeline or schedule.timeline
    cells = [["."] * timeline.span for _ in range(schedule.pp)]
    for rank, starts in enumerate(timeline.starts):
        for start, action in starts:
            for tick in range(start, start + COSTS[action.kind]):
                cells[rank][tick] = str(action)
    width = width or max([len(c) for row in cells for c in row] + [1])
    title = (f"{schedule.name}: pp={schedule.pp}, {schedule.microbatches} micro-batches"
             + (f", {schedule.virtual_stages} stages per rank" if schedule.virtual_stages > 1
                else "") + f"; bubble {timeline.bubble:.1%} "
             f"(theory {schedule.theoretical_bubble():.1%})")
    label = len(f"rank {schedule.pp - 1}")
    lines = [title] + [f"{'rank ' + str(r):<{label}}  " + " ".join(c.ljust(width) for c in row)
                       .rstrip() for r, row in enumerate(cells)]
    return "\n".join(lines)
