"""One step of a pipeline: this rank's list of the schedule's actions, run in order.

Compute actions call the stages (forward, backward, or its input-gradient part I and
weight-gradient part W through the engine's split backward); the transfers between two compute
actions are posted as one `batch_isend_irecv` on the pp group and waited for just before the
action that reads them (waiting for a peer is idle time, not the action's). A stage's input and
output cross ranks as local arrays between the ranks at the same coordinate of the stage mesh,
and are DTensors of the same layout on both sides; a received activation is a leaf that requires
a gradient, so the stage's backward stops there and its gradient is what goes back.

Micro-batch k is rows k of an array_split of the batch, and its loss counts by its share of the
batch's targets, so a step's loss and gradients are those of the batch without a pipeline.
Data parallelism (replicated or fully sharded stages) reduces each stage's gradients once per
step, in the stage's last backward (B, or ZB-H1's last W), overlapped with it: the backwards
before it only sum them, and a fully sharded stage keeps its gathered parameters from its first
forward to that backward (PyTorch's pipelining does the same with FSDP2).
Random draws (dropout) are the batch's too: each stage's forwards run inside its micro-batch
(`Microbatches` of the default generator, starting where the earlier stages' draws over the
whole batch end), so stage s draws for micro-batch k what one pass of the whole model over the
whole batch draws for those rows; a recomputation in the backward draws again as its forward
did (`Generator.replaying`), and the backward draws nothing else (nor does ZB-H1's W). After
the step the generator's offset is where that pass leaves it, on every rank.

The shapes a stage receives are learned before the first step with a new batch shape (or train
or eval mode): each stage in turn runs its forward on zeros of its input's shape (no gradients,
the random generator left as it was) and tells the next stage's rank what it makes; every
stage's count of counters drawn over the whole batch is then shared. The pass goes stage after
stage, one way, so it cannot wait in a circle as the step's transfers could.
"""
import contextlib
import dataclasses
import time

import numpy

from cupytp import backend
from cupytp.autograd import engine
from cupytp.ops.amp import parameters_changed, separate_casts
from cupytp.distributed.process_group import CollectiveTimeoutError, split_sizes
from cupytp.parallel.data_parallel import DataParallelModule, FSDPModule
from cupytp.parallel.pipeline import schedules
from cupytp.tensor import (
    DTensor, Microbatches, Partial, Replicated, Shard, default_generator, from_local)
from cupytp.tensor.layout import Layout
from cupytp.tensor.redistribute import grad_placements, redistribute_local


class PipelineError(RuntimeError):
    """An action of a pipeline stage failed; the message names the stage, the action and the
    micro-batch."""


@dataclasses.dataclass
class PipelineStats:
    """What `step(measure=...)` saw on the ranks of this pipeline: the schedule's name, the
    measure ("ticks": each compute action costs its ticks (F 1, B 2, I 1, W 1) and a receive
    waits for its send, as a Lamport clock; "time": seconds), per rank the busy time and the
    time its last action ended, the measured bubble (idle share of all ranks' time up to the
    last end), the schedule's simulated and theoretical bubbles, and with ticks the measured
    Timeline (`format_schedule(schedule, timeline)` draws it)."""
    schedule: str
    measure: str
    busy: tuple
    end: tuple
    bubble: float
    simulated: float
    theoretical: float
    timeline: object = None

    def __str__(self):
        return (f"{self.schedule}: bubble {self.bubble:.1%} measured in {self.measure}, "
                f"{self.simulated:.1%} simulated, {self.theoretical:.1%} in theory")


class StepRun:
    """One step of a Pipeline on a batch: `execute()` runs this rank's actions and leaves the
    batch's loss in `loss`. Meanwhile it holds each stage's inputs and outputs by micro-batch,
    the transfers in flight, the deferred weight gradients and the clock."""

    def __init__(self, pipe, inputs, targets, measure, scaler):
        self.pipe, self.schedule = pipe, pipe.schedule
        self.scaler = scaler
        self.training = engine.is_grad_enabled()
        self.measure = measure
        self.sizes = split_sizes(inputs.shape[0], self.schedule.microbatches)
        starts = numpy.cumsum([0] + self.sizes)
        self.rows = [slice(a, b) for a, b in zip(starts[:-1], starts[1:])]
        self.inputs, self.targets = inputs, targets
        context = pipe.context      # the sequence split over cp: the stages take its tokens'
        self.positions = () if context is None else (context.positions(inputs.shape[1]),)
        self.weights = _loss_weights(targets, self.rows, pipe._parts.ignore_index)
        signature = (tuple(inputs.shape), str(inputs.dtype), tuple(targets.shape),
                     str(targets.dtype), pipe.training)
        if signature not in pipe._shapes:
            pipe._shapes[signature] = self._learn_shapes()
        self.shapes = pipe._shapes[signature]
        self.x, self.out, self.deferred = {}, {}, {}
        self.syncing = _last_backwards(self.schedule.actions[pipe.pp_rank])
        self.draws = {}               # stage -> its Microbatches of the default generator
        self.receiving = {}           # transfer (kind, stage, micro-batch) -> (Work, index)
        self.arrived = {}             # transfer -> its array, waited for
        self.sending = []             # Works of sends in flight
        self.loss_local = None
        self.clock, self.busy, self.starts, self.t0 = 0, 0, [], time.perf_counter()

    # -- the loop ----------------------------------------------------------------------------
    def execute(self):
        pipe = self.pipe
        actions = self.schedule.actions[pipe.pp_rank]
        if not self.training:
            actions = [a for a in actions if a.kind in (schedules.FORWARD, schedules.SEND_F,
                                                          schedules.RECV_F)]
        self._sync_tied_weights()
        if self.measure == "time":
            pipe.pp_group.barrier()
        self.t0 = time.perf_counter()
        start, counts = default_generator.offset, self.shapes["draws"]
        for s in self.schedule.stages_of(pipe.pp_rank):
            self.draws[s] = Microbatches(default_generator, self.sizes, start + sum(counts[:s]))
        try:
            if self.training:
                for stage in pipe.stages:
                    _gradient_sync(stage, False)
            batch = []
            for action in actions:
                if action.is_compute:
                    self._post(batch)
                    batch = []
                    self._compute(action)
                else:
                    batch.append(action)
            self._post(batch)
        finally:
            for stage in pipe.stages:   # as the stages were (after a failed step as well)
                _gradient_sync(stage, True)
        default_generator.offset = start + sum(counts)      # where the whole batch's pass ends
        for work in self.sending:
            work.wait()
        if self.training:
            self._reduce_tied_grads()
        self._finish_loss()
        if self.measure is not None:
            self._record_stats()

    def _compute(self, action):
        run = {schedules.FORWARD: self._forward, schedules.BACKWARD: self._backward,
               schedules.BACKWARD_INPUT: self._backward_input,
               schedules.BACKWARD_WEIGHT: self._backward_weight}[action.kind]
        self._await_inputs(action)        # waiting for a peer is idle time, not the action's
        stage, syncing = self.pipe._stage[action.stage], action in self.syncing
        if syncing:
            _gradient_sync(stage, True)
        start = self._now()
        with _named_errors(action.stage, self.pipe.pp_rank, _NAMES[action.kind],
                           action.microbatch):
            run(action.stage, action.microbatch)
            if syncing and isinstance(stage, DataParallelModule):
                stage.finish_gradient_sync()    # what its last pass did not reduce
        self.starts.append((start, action))
        if self.measure == "ticks":
            self.clock += schedules.COSTS[action.kind]
            self.busy += schedules.COSTS[action.kind]
        elif self.measure == "time":
            self.busy += self._now() - start

    def _now(self):
        if self.measure == "ticks":
            return self.clock
        if self.measure == "time":
            if backend.on_gpu:
                backend.synchronize()
            return time.perf_counter() - self.t0
        return None

    # -- compute actions ---------------------------------------------------------------------
    def _forward(self, s, k):
        stage = self.pipe._stage[s]
        if s == 0:
            x = self._laid_out(self.inputs[self.rows[k]])
        else:
            x = self._received_input(s, k)
        with self.draws[s].microbatch(k) as drawing, separate_casts():    # each micro-batch's
            out = stage(x, *self.positions)         # backward walks (and frees) its own casts
        drawn, learned = default_generator.offset - drawing.start, self.shapes["draws"][s]
        if drawn != learned:
            raise RuntimeError(f"its forward drew {drawn} random counters over the whole batch "
                               f"where {learned} were learned with this batch shape: its "
                               "dropout was switched on or off since; switch it before the "
                               "first step of a batch shape, or make a new pipeline")
        if stage.is_last:
            loss = self.pipe._parts.loss(out, self._laid_out(self.targets[self.rows[k]]))
            weight = self.weights[k]
            if not isinstance(weight, float):      # counted on the device: no host sync
                weight = DTensor._make(weight.astype(loss.dtype), loss.layout.with_placements(
                    (Replicated(),) * loss.mesh.ndim))
            out = loss * weight
            if self.loss_local is None:
                self.loss_local = backend.xp.array(out.to_local(), copy=True)
            else:
                self.loss_local += out.to_local()
            if self.scaler is not None and self.training:
                out = self.scaler.scale(out)
        if self.training:
            self.x[(s, k)], self.out[(s, k)] = x, out
        elif not stage.is_last:
            self.out[(s, k)] = out

    def _backward(self, s, k):
        out = self.out.pop((s, k))
        engine.backward(out, self._output_grad(s, k, out))
        if s == 0:
            del self.x[(s, k)]            # token ids: no gradient to send

    def _backward_input(self, s, k):
        """The input's gradient now (the first stage has none: all of it waits for W)."""
        out = self.out.pop((s, k))
        if s == 0:
            del self.x[(s, k)]
        inputs = [self.x[(s, k)]] if s > 0 else []
        self.deferred[(s, k)] = engine.backward(out, self._output_grad(s, k, out), inputs)

    def _backward_weight(self, s, k):
        self.deferred.pop((s, k)).run()

    def _output_grad(self, s, k, out):
        """The gradient of stage s's output for micro-batch k: 1 for the last stage's loss,
        else the next stage's input gradient (received, or from this rank)."""
        if self.pipe._stage[s].is_last:
            return DTensor._make(backend.xp.ones(out.local_shape, out.dtype),
                                 out.layout.with_placements(grad_placements(out.placements)))
        layout = out.layout.with_placements(grad_placements(out.placements))
        if self.schedule.rank_of(s + 1) == self.pipe.pp_rank:
            local = self._input_grad(s + 1, k)
        else:
            local = self._take((schedules.SEND_B, s + 1, k))
        return DTensor._make(local, layout)

    def _input_grad(self, s, k):
        """The local gradient of stage s's input for micro-batch k (zeros if none flowed)."""
        x = self.x.pop((s, k))
        return x.grad.to_local() if x.grad is not None else \
            backend.xp.zeros(x.local_shape, x.dtype)

    def _received_input(self, s, k):
        """Stage s's input for micro-batch k as a leaf: the previous stage's output, received
        or from this rank."""
        if self.schedule.rank_of(s - 1) == self.pipe.pp_rank:
            before = self.out[(s - 1, k)] if self.training else self.out.pop((s - 1, k))
            local, layout = before.to_local(), before.layout
        else:
            shape, placements, _ = self.shapes[(s, k)]
            local = self._take((schedules.SEND_F, s - 1, k))
            layout = Layout(self.pipe.stage_mesh, shape, placements)
        x = DTensor._make(local, layout)
        x.requires_grad = self.training
        return x

    # -- communication -----------------------------------------------------------------------
    def _post(self, batch):
        """Post a batch of sends and receives as one batch_isend_irecv."""
        if not batch:
            return
        group, sends, recvs, keys = self.pipe.pp_group, [], [], []
        for a in batch:
            peer = schedules.peer_of(a, self.schedule.pp)
            if a.kind == schedules.SEND_F:
                out = self.out[(a.stage, a.microbatch)]
                sends.append((out.to_local(), peer))
                if not self.training:
                    del self.out[(a.stage, a.microbatch)]
            elif a.kind == schedules.SEND_B:
                sends.append((self._input_grad(a.stage, a.microbatch), peer))
            elif a.kind == schedules.RECV_F:
                shape, placements, dtype = self.shapes[(a.stage, a.microbatch)]
                local = Layout(self.pipe.stage_mesh, shape, placements).local_shape
                recvs.append((local, dtype, peer))
                keys.append((schedules.SEND_F, a.stage - 1, a.microbatch))
            else:
                out = self.out[(a.stage, a.microbatch)]
                recvs.append((out.local_shape, out.dtype, peer))
                keys.append((schedules.SEND_B, a.stage + 1, a.microbatch))
        work = group.batch_isend_irecv(sends, recvs)
        if sends:
            self.sending.append(work)
        for index, key in enumerate(keys):
            self.receiving[key] = (work, index)
        if self.measure == "ticks":
            self._exchange_ticks(batch)

    def _await_inputs(self, action):
        """Wait for the transfers `action` reads (a received input or output gradient)."""
        s, k, rank_of = action.stage, action.microbatch, self.schedule.rank_of
        if action.kind == schedules.FORWARD and s > 0 and rank_of(s - 1) != self.pipe.pp_rank:
            self._await((schedules.SEND_F, s - 1, k))
        elif action.kind in (schedules.BACKWARD, schedules.BACKWARD_INPUT) and \
                s < self.schedule.stages - 1 and rank_of(s + 1) != self.pipe.pp_rank:
            self._await((schedules.SEND_B, s + 1, k))

    def _await(self, transfer):
        if transfer in self.receiving:
            work, index = self.receiving.pop(transfer)
            self.arrived[transfer] = work.wait()[index]

    def _take(self, transfer):
        """The array a transfer brought."""
        self._await(transfer)
        return self.arrived.pop(transfer)

    def _learn_shapes(self):
        """{(stage, micro-batch): (shape, placements, dtype) of its input} for the stages whose
        input comes from another rank, the loss's dtype under "loss", and under "draws" each
        stage's count of the generator's counters its forward draws over the whole batch
        (module docstring)."""
        pipe, schedule = self.pipe, self.schedule
        group, shapes, told, draws = pipe.pp_group, {}, [], {}
        state = default_generator.get_state()
        try:
            with engine.no_grad():
                for s in schedule.stages_of(pipe.pp_rank):
                    before = schedule.rank_of(s - 1) if s > 0 else None
                    drawing = Microbatches(default_generator, self.sizes)
                    for k, rows in enumerate(self.rows):
                        if s == 0:
                            x = self._laid_out(self.inputs[rows])
                        else:
                            if before != pipe.pp_rank:
                                shapes[(s, k)] = group.recv_object(before).wait()
                            shape, placements, dtype = shapes[(s, k)]
                            layout = Layout(pipe.stage_mesh, shape, placements)
                            x = DTensor._make(backend.xp.zeros(layout.local_shape, dtype), layout)
                        with _named_errors(s, pipe.pp_rank, "the forward (learning shapes)", k), \
                                drawing.microbatch(k):
                            out = pipe._stage[s](x, *self.positions)
                            if s == schedule.stages - 1:
                                targets = self._laid_out(self.targets[rows])
                                shapes["loss"] = str(pipe._parts.loss(out, targets).dtype)
                                continue
                        shapes[(s + 1, k)] = (out.shape, out.placements, str(out.dtype))
                        if schedule.rank_of(s + 1) != pipe.pp_rank:
                            told.append(group.send_object(shapes[(s + 1, k)],
                                                          schedule.rank_of(s + 1)))
                    draws[s] = default_generator.offset - drawing.start
        finally:
            default_generator.set_state(state)
        for work in told:
            work.wait()
        everyone = pipe.pp_group.all_gather_object((shapes.get("loss"), draws))
        shapes["loss"] = everyone[schedule.rank_of(schedule.stages - 1)][0]
        counts = {s: n for _, theirs in everyone for s, n in theirs.items()}
        shapes["draws"] = tuple(counts[s] for s in range(schedule.stages))
        return shapes

    def _exchange_ticks(self, batch):
        """The Lamport clock: each send carries this rank's tick; a receive moves the clock to
        the sender's tick when that is later."""
        group, stamps = self.pipe.pp_group, []
        for a in batch:
            peer = schedules.peer_of(a, self.schedule.pp)
            if a.kind in (schedules.SEND_F, schedules.SEND_B):
                self.sending.append(group.send_object(self.clock, peer))
            else:
                stamps.append(group.recv_object(peer))
        self.clock = max([self.clock] + [stamp.wait() for stamp in stamps])

    # -- tied parameters (embeddings shared by the first and last stage) -------------------------
    def _sync_tied_weights(self):
        """The first stage sends the tied parameters to the last stage's copies."""
        def give(t, placements):    # gathered over "dp" when the first stage is fully sharded
            if placements == t.placements:
                return t.to_local()
            return redistribute_local(t.to_local(), t.layout, placements)[0]

        def take(t, local):
            t.to_local()[...] = local
            parameters_changed()    # casts made of the copy (learning the shapes) are stale
        self._move_tied(give, take, from_first=True)

    def _reduce_tied_grads(self):
        """The last stage's gradients of its tied copies go to the first stage's parameters."""
        def take(t, placements):
            local = t.grad.to_local() if t.grad is not None else \
                backend.xp.zeros(t.local_shape, t.dtype)
            t.grad = None
            return local

        def add(t, local):      # the last stage's sums over its share of the batch's tokens:
            placements = list(grad_placements(self._tied_placements(t)))   # reduced over dp
            for name in ("dp", "cp"):       # and cp here, to t's gradient, which data
                if name in t.mesh.dim_names:    # parallelism reduced already
                    placements[t.mesh.dim_names.index(name)] = Partial()
            g = DTensor._make(local, t.layout.with_placements(tuple(placements)))
            g = g.redistribute(grad_placements(t.placements))
            if t.grad is None:
                t.grad = g
            else:
                t.grad.to_local()[...] += g.to_local()
        self._move_tied(take, add, from_first=False)

    def _tied_placements(self, tensor):
        return next(p for t, p in self.pipe._tied if t is tensor)

    def _move_tied(self, give, take, from_first):
        pipe = self.pipe
        if not pipe._tied:
            return
        first, last = 0, self.schedule.rank_of(self.schedule.stages - 1)
        source, target = (first, last) if from_first else (last, first)
        group = pipe.pp_group
        if pipe.pp_rank == source:
            works = group.batch_isend_irecv([(give(t, p), target) for t, p in pipe._tied], [])
            works.wait()
        else:
            shapes = [(Layout(t.mesh, t.shape, p).local_shape, t.dtype, source)
                      for t, p in pipe._tied]
            for (t, _), local in zip(pipe._tied, group.batch_isend_irecv([], shapes).wait()):
                take(t, local)

    # -- the loss and the statistics -----------------------------------------------------------
    def _finish_loss(self):
        """The batch's loss from the last stage, on every rank: Partial along the pipeline (the
        other stages' terms zeros), all-reduced."""
        pipe = self.pipe
        local = self.loss_local if self.loss_local is not None else \
            backend.xp.zeros((), dtype=self.shapes["loss"])
        loss = from_local(local, pipe.pp_mesh, (Partial(),), shape=(), run_check=False)
        local = loss.redistribute((Replicated(),)).to_local()
        self.loss = DTensor._make(local, Layout(pipe.stage_mesh, (), (Replicated(),) *
                                                pipe.stage_mesh.ndim))

    def _record_stats(self):
        pipe = self.pipe
        end = self.clock if self.measure == "ticks" else self._now()
        everyone = pipe.pp_group.all_gather_object((self.busy, end, self.starts))
        busy, ends, starts = zip(*everyone)
        span = max(ends)
        timeline = schedules.Timeline(tuple(tuple(s) for s in starts), tuple(busy), span) \
            if self.measure == "ticks" else None
        bubble = 1.0 - sum(busy) / (len(busy) * span) if span else 0.0
        object.__setattr__(pipe, "stats", PipelineStats(
            self.schedule.name, self.measure, tuple(busy), tuple(ends), bubble,
            self.schedule.timeline.bubble, self.schedule.theoretical_bubble(), timeline))

    def _laid_out(self, array):
        """A micro-batch's rows on the stage mesh: Shard(0) on "dp", Replicated on the rest;
        this rank keeps its own block. Under context parallelism its sequence in the ring's
        order, Shard(1) along cp."""
        mesh = self.pipe.stage_mesh
        placements = tuple(Shard(0) if name == "dp" else Replicated() for name in mesh.dim_names)
        layout = Layout(mesh, array.shape, placements)
        offsets, shape = layout.local_block()
        block = array[tuple(slice(o, o + n) for o, n in zip(offsets, shape))]
        x = DTensor._make(backend.xp.ascontiguousarray(backend.asarray(block)), layout)
        return x if self.pipe.context is None else self.pipe.context.shard(x)


@contextlib.contextmanager
def _named_errors(stage, rank, what, microbatch):
    """An error inside becomes a PipelineError naming the stage, the action and the
    micro-batch (a timeout or a PipelineError passes as it is)."""
    try:
        yield
    except (CollectiveTimeoutError, PipelineError):
        raise
    except Exception as err:
        raise PipelineError(f"stage {stage} (pp rank {rank}) failed in {what} of micro-batch "
                            f"{microbatch}: {type(err).__name__}: {err}") from err


def _last_backwards(actions):
    """Each stage's last action that computes weight gradients (B, or ZB-H1's W): the one whose
    backward reduces the stage's gradients."""
    last = {}
    for action in actions:
        if action.kind in (schedules.BACKWARD, schedules.BACKWARD_WEIGHT):
            last[action.stage] = action
    return set(last.values())


def _gradient_sync(stage, sync):
    """Whether the stage's next backward reduces its gradients and then frees the parameters a
    fully sharded stage gathered (True), or only sums them and keeps those (False)."""
    if isinstance(stage, DataParallelModule):
        stage.set_requires_gradient_sync(sync)
    if isinstance(stage, FSDPModule):
        stage.set_reshard_after_backward(sync)


_NAMES = {schedules.FORWARD: "the forward", schedules.BACKWARD: "the backward",
          schedules.BACKWARD_INPUT: "the input-gradient backward",
          schedules.BACKWARD_WEIGHT: "the weight-gradient backward"}


def _loss_weights(targets, rows, ignore_index):
    """Each micro-batch's share of the batch's counted targets (those != ignore_index): floats
    for host targets, 0-d float64 device arrays for device targets (counted there, with no
    host synchronization, so a captured CUDA graph counts each replay's)."""
    if isinstance(targets, numpy.ndarray):
        counts = [float((targets[r] != ignore_index).sum()) for r in rows]
        total = sum(counts) or 1.0
        return [c / total for c in counts]
    xp = backend.xp
    counts = [(targets[r] != ignore_index).sum(dtype=xp.float64) for r in rows]
    total = xp.maximum(sum(counts), 1.0)
    return [c / total for c in counts]
