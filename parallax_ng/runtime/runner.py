"""Runner: drives a step graph with the user's own fetches and feeds.

Requires: a Program (parallax_ng/runtime/program.py): the graph the
data-parallel passes made, or layer-to-layer execution's, with its fetch
map, executor and checkpoints.
Guarantees: `run(fetches, feed_dict)` takes tensors, ops, variables or names
of the user's single-device graph (any nesting of lists, tuples, dicts) and
returns what one device would return for the global batch:
- an op runs in every replica (shared ops once);
- a tensor that is equal on all replicas (variables, global step, aggregated
  gradients) comes from replica 0;
- a tensor computed from a replica's own data is combined: scalars by mean,
  tensors with a batch dimension (of any type) by concatenation along its
  axis, a reduce_any/reduce_all by any/all, a TF1 summary tag by tag
  (runtime/summaries.py), other strings and booleans from replica 0;
  `config.fetch_reduction` overrides per tensor (mean, sum, concat, first);
- `run(..., per_replica=True)` returns a list with every replica's value instead.
Feeds of placeholders with an unknown leading dimension are split evenly
across replicas (a run that trains must divide by the replica count; one
that does not runs replica 0 alone: runtime/one_replica.py), and so is a
feed of N times a fixed leading dimension (a fetched RNN state fed back);
other feeds go to every replica unchanged (with a warning, once, for a
placeholder on the gradients' path fed exactly its fixed batch; fetches.py).
Layer-to-layer execution maps fetches and feeds its own way
(parallax_ng/l2l/runner.py); the rest holds for it too, except measuring
and planning again.
A run is one step of session runs (parallax_ng/runtime/executor.py: one, or two at
once in a job whose step has collectives beside server work); after one that
initialized (or trained, where the training run does not hold it), a job
with parameter servers meets at its barrier.
The first `config.profile.steps` training runs are traced and measured
(parallax_ng/planning/profile.py); the planner then plans again with the
measurements and, when the plan's decisions change (or with
`profile.replan: always`), the graph is transformed again and training goes
on in a new session holding the same state, its lookup tables filled again
(in-process runs without queue input, mutable tables or uncounted stateful
random ops in the step: runtime/moves.py; otherwise the measured
plan is kept and the graph stays); the old graph is freed then. Tuned sizes
(runtime/tuning.py) move training likewise (in a job, every worker at once).
With checkpoints, SIGTERM (a preemption) makes the job save the step every
worker stops at and end each worker's process with SystemExit(143)
(parallax_ng/runtime/preemption.py).
"""
from __future__ import annotations

import atexit
import gc
import sys
import tempfile
import time
import warnings
import weakref
from dataclasses import replace
from functools import cached_property

import tensorflow as tf

from ..errors import UnevenFeed, explained
from ..graph import capture, tables
from ..graph.rules import READ_PREFIXES
from ..methods import method
from ..planning.analysis import unknown_rows
from ..planning.profile import Profile, measure
from ..saving import saved_by
from . import heartbeat, moves, one_replica, preemption, serving, tuning
from .checkpoint import Checkpointer
from .combining import combine
from .preemption import Preemption
from .program import Program, bounded, traced
from .timeline import Timeline

FLUSH_GRAPH_KEY = 7   # any nonzero key: the run gets a collective executor


class Runner:
    def __init__(self, program: Program, config, session_config, server=None,
                 replan=None, rebuild=None, tuner=None):
        """`replan`: profile -> Plan (None: keep the plan, add measurements);
        `rebuild`: Plan -> Program (None: the graph stays); `tuner`: tries
        sizes while training (parallax_ng/runtime/tuning.py)."""
        self.config = config
        self.server = server     # this worker's gRPC server in cluster mode
        self._session_config = session_config
        self._replan, self._rebuild = replan, rebuild
        self._restored, self._steps, self._closed = False, 0, False
        self._saved, self._failed = None, False   # the step last saved; a run raised
        self._told_trained = False    # the launcher heard of this process's first step
        self.profile: Profile | None = None
        self.replans = 0
        self._install(program)
        self._tuner = self._tuned = tuning.usable(tuner, self._cannot_move_state,
                                                  program.worker)
        self._timeline = Timeline.of(config, self.plan, self.graph)
        self._end = serving.End()       # in a job: what this worker does at its end
        self._end.bind(self, program)
        self._stop_idle_servers()
        self._preemption = None
        if config.checkpoint.dir:   # the last steps saved when the process ends, before
            ref = weakref.ref(self)  # the servers hear this worker is done (atexit: LIFO)
            atexit.register(lambda: (r := ref()) is not None and r.save_final())
            checkpoints = program.checkpoints
            self._preemption = Preemption(config.checkpoint.dir, checkpoints.worker,
                                          checkpoints.workers)

    def _install(self, program: Program) -> None:
        """Graph, session and everything bound to them, for one Program."""
        self.program, self.plan, self.ctx = program, program.plan, program.ctx
        self.pass_records = list(program.records)
        self.graph, self.fetches = program.graph, program.fetches
        self.executor, self._options = program.executor, program.options
        self._checkpoints, self._queues = program.checkpoints, program.queues
        self._target = self.server.target if self.server is not None else ""
        self.session = tf.compat.v1.Session(self._target, graph=self.graph,
                                            config=self._session_config)
        if program.start:
            self.session.run(program.start, options=self._options)
        self._kinds, self._reach = {}, one_replica.Reach(self.graph)   # `_kind`; uneven feeds
        self._reached: dict[tuple, frozenset] = {}      # `_kind`: the user ops a run reaches
        self._flush = list(program.flush)
        self._pending = False     # a training run left part of a table's update

    # -- public API -----------------------------------------------------------
    def run(self, fetches, feed_dict=None, options=None, run_metadata=None,
            per_replica: bool = False):
        leaves = tf.nest.flatten(fetches)
        wanted = [self.fetches.fetch_leaf(leaf, per_replica) for leaf in leaves]
        fetched = tuple(f.user for f in wanted)
        _, trained, reads_queue, reads_parts = self._kind(fetched)
        try:
            feeds = self.fetches.feeds(feed_dict)
        except UnevenFeed:          # an evaluation of a whole test set: on replica 0 alone
            if trained or self._reach.needs_every_replica(wanted):
                raise
            feeds, wanted = self.fetches.feeds(feed_dict, True), one_replica.alone(wanted)
        names = [n for f in wanted for n in f.names]
        if not trained:
            one_replica.refuse_untrained(self.program.tg, self.plan, self._reached[fetched])
            self._apply_pending()
            if reads_parts:
                self.executor.wait_for_parts(self.session)
        profiling = trained and self.ctx is not None and \
            self._profiled < self.config.profile.steps
        probe = self._probe(fetched) if profiling else {}
        options = bounded(options, self._options)
        tracing = trained and self._timeline is not None and self._timeline.wants()
        if profiling or tracing:
            options, run_metadata = traced(options, run_metadata, self._target)
        start = time.time()
        if reads_queue and self._queues is not None:
            self._queues.start(self.session)
        try:
            with heartbeat.running():
                values = self.executor.run(self.session, names + list(probe.values()), feeds,
                                           options=options, run_metadata=run_metadata)
        except (tf.errors.OutOfRangeError, tf.errors.CancelledError):
            if self._queues is not None:
                self._queues.raise_failure()   # a queue runner's error closed its queue
            raise
        except BaseException as e:
            self._failed = trained
            told = explained(e)
            if told is e:
                raise
            raise told from e
        self._pending = self._pending or (trained and bool(self._flush))
        if trained and self._timeline is not None:
            self._timeline.record(run_metadata if tracing else None, start, time.time())
        if profiling:
            self._measured(run_metadata, dict(zip(probe, values[len(names):])))
        self._after_run(fetched)
        if trained and self._tuner is not None and self._profiled >= self.config.profile.steps:
            moved = self._tuner.trained(time.time() - start, self.profile)
            if moved is not None:
                self._move_to(moved, "a tuned size's graph")
        out, i = [], 0
        for f in wanted:
            out.append(combine(values[i:i + len(f.names)], f))
            i += len(f.names)
        return tf.nest.pack_sequence_as(fetches, out)

    @property
    def tuned(self) -> dict:
        """What tuning tried and chose: {knob: {"chosen": bytes, "tried":
        {bytes: median step seconds}}} (parallax_ng/runtime/tuning.py)."""
        return self._tuned.tuned if self._tuned is not None else {}

    def session_runs(self, fetches) -> int:
        """How many session.runs one `run(fetches)` makes: one, or two at once
        (a job step's collectives beside its server work), and the job's
        barrier where it is a run of its own."""
        wanted = [self.fetches.fetch_leaf(leaf) for leaf in tf.nest.flatten(fetches)]
        initialized, trained, *_ = self._kind(tuple(f.user for f in wanted))
        runs = len(self.executor.runs([n for f in wanted for n in f.names]))
        return runs + int(self.executor.ends_with_barrier(initialized, trained))

    def save(self, saver, path: str, **kwargs) -> str:
        """`saver.save(session, path, **kwargs)` for the user's Saver (saving.py):
        replica 0's variables by their single-device names, as one device's."""
        return saved_by(self, self.program.tg.user_graph, saver, path, **kwargs)

    closed = property(lambda self: self._closed)

    def restore(self, saver, path: str) -> None:
        """Restore every replica's copy (and the shared variables) from `path`."""
        d = saver.saver_def
        self.run(d.restore_op_name, {d.filename_tensor_name: path})
        self.executor.end_step(self.session)

    def save_final(self) -> None:
        """Save the steps trained since the last checkpoint (at close, and
        when the process ends), unless the last training run failed."""
        if self._checkpoints is None or self._failed or not self._steps or self._closed:
            return
        step = self._global_step()
        step = self._steps if step is None else step
        if step != self._saved:
            self._save(step)

    def _save(self, step: int) -> None:
        self._apply_pending()
        self.executor.wait_for_parts(self.session)
        path = self._checkpoints.save(self.session, step)
        self._saved = step
        if self.program.worker == 0:
            print(f"parallax_ng: saved step {step} to {path}", file=sys.stderr, flush=True)
            heartbeat.tell("saved", f"{step} {path}")

    def _stop_idle_servers(self) -> None:
        """Tell the servers this worker is done when the plan puts nothing
        on them (idle servers would only share the CPUs) and tuning will not
        move to a plan that does. Only before the first step: where a tuned
        plan leaves them idle they stay, as stopping servers this worker's
        sessions have reached slowed its steps (docs/benchmarks.md)."""
        if not (self.program.servers_idle and self._end.may_tell(self.program)) or \
                self._tuner is not None and self._tuner.may_move_plan():
            return
        self._end.tell_servers(self, self.program)
        if self.program.worker == 0:
            print("parallax_ng: the plan puts nothing on the parameter servers; they stop",
                  file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._timeline is not None:
            self._timeline.finish()
        self.save_final()
        if self._queues is not None:
            self._queues.stop()
        self._end()
        self.session.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def _apply_pending(self) -> None:
        """Apply the rows of tables whose update waits for the next step
        (prefetch: transforms/prefetch.py), so what is read holds every
        step's update."""
        if self._pending:
            options = tf.compat.v1.RunOptions()
            options.CopyFrom(self._options)
            # its collectives are all AllToAllV2, which TensorFlow's session
            # does not count when it decides whether a run needs collectives
            options.experimental.collective_graph_key = FLUSH_GRAPH_KEY
            self.session.run(self._flush, options=options)
            self._pending = False

    # -- profile, then plan again ----------------------------------------------
    @property
    def _profiled(self) -> int:
        return self.profile.steps if self.profile is not None else 0

    def _probe(self, fetched: tuple) -> dict[str, str]:
        """Replica 0's gradient indices of the sparse variables (and the
        first factors of those by factors whose rows the graph does not
        know) that the run of `fetched` computes: another train op's (a
        program's second optimizer) would read its batch, skipping it."""
        plan, grads = self.plan.variables, self.ctx.tg.gradients
        probe = {**{v: str(grads[v].indices) for v, vp in sorted(plan.items()) if vp.info.sparse},
                 **unknown_rows(self.ctx.tg, {v: vp.info for v, vp in plan.items()
                                              if method(vp.method).factored})}
        return {v: t for v, t in probe.items() if t.split(":")[0] in self._reached[fetched]}

    def _measured(self, run_metadata, indices: dict) -> None:
        step = measure(self.ctx.tg, run_metadata, indices)
        self.profile = step if self.profile is None else self.profile.merge(step)
        if self.profile.steps == self.config.profile.steps:
            if self._wants_fit():
                from ..planning import costfit
                fit = costfit.measure("", list(self.plan.devices), self.plan.group_size,
                                      costfit.sizes(costfit.model_bytes(self.ctx.tg,
                                                                        self.plan)),
                                      self._session_config, self.plan.timeout_seconds)
                self.profile = replace(self.profile, allreduce=fit)
            capture.profiled(self._plan_again(), self.profile, self.ctx.tg)

    def _wants_fit(self) -> bool:
        """In-process with TF collectives over several devices, when mgwfbp
        buckets or run_option auto need the all-reduce cost or `parallax-ng
        profile` asks for it (a job measures before its graph is built)."""
        plan, buckets = self.plan, self.config.buckets
        return (self.server is None and plan.backend == "tf" and len(plan.devices) > 1 and
                plan.group_size == len(plan.devices) and
                (buckets.mode == "mgwfbp" and buckets.a is None and not buckets.profile
                 or self.config.run_option == "auto" and self.config.network.bandwidth is None
                 or capture.wants_fit()))

    def _plan_again(self):
        """Plan with the measurements; transform again if the decisions
        change. Returns the measured plan. Where the graph stays, `plan`
        keeps the decisions the graph was built with (and gets the
        measurements), so it says what runs."""
        if self._replan is None:
            plan = self.profile.measured(self.plan, self.ctx.tg)
        else:
            plan = self._replan(self.profile)
        how = self.config.profile.replan
        same = plan.decisions() == self.plan.decisions()
        why = self._cannot_move_state() if self._rebuild is not None else "no transformer"
        if how == "never" or (how == "auto" and same) or why:
            if why and how != "never" and (how == "always" or not same):
                warnings.warn(f"the measured plan differs but training goes on with the "
                              f"graph it has: {why}", stacklevel=4)
            self.plan = self.ctx.plan = plan if same else \
                self.profile.measured(self.plan, self.ctx.tg)
            return plan
        self._move_to(self._rebuild(plan))
        return plan

    def _cannot_move_state(self, jobs: bool = False) -> str | None:
        return moves.why_not(self.ctx, self.plan, jobs)

    def _move_to(self, program: Program, what: str | None = None) -> None:
        """Go on in a session of the new graph: every variable and input
        position carried over through a checkpoint (in a job, each worker
        its own, then the job's barrier; a server's variables stay where
        they are). If that fails, training goes on where it was (with the
        measured plan; `what` the tuner's graph: no more tuning)."""
        self._apply_pending()
        self.executor.wait_for_parts(self.session)
        before = dict(self.__dict__)
        with tempfile.TemporaryDirectory() as tmp:
            path = Checkpointer(self.graph, moves.layout(self.ctx), tmp).save(self.session, 0)
            try:
                self._install(program)
                restore = Checkpointer(self.graph, moves.layout(self.ctx), tmp)
                # an iterator takes a position only once it exists; a table is filled again
                self.session.run([op for op in self.graph.get_operations()
                                  if op.type == "MakeIterator" or op.type in tables.FILLS])
                restore.restore(self.session, path)
                self.executor.end_step(self.session)
            except tf.errors.OpError as e:
                self.session.close()
                self.__dict__.update(before)
                if what is None:
                    self.plan = self.ctx.plan = self.profile.measured(self.plan,
                                                                      self.ctx.tg)
                self._tuner = None
                warnings.warn(f"{what or 'the measured plan'} differs but training goes on "
                              f"with the graph it has: moving its state failed ({e.message})",
                              stacklevel=5)
                return
        before["session"].close()
        self._end.bind(self, program)
        self._restored = True
        self.replans += what is None
        gc.collect()        # the old graph's cycles, else held until a full collection

    # -- checkpoints and barriers ---------------------------------------------
    def _after_run(self, fetched: tuple) -> None:
        """Restore after the first run that initialized variables; meet the
        other workers after initialisation and after each training step
        (multi-worker jobs with parameter servers); save every
        `checkpoint.every_steps` training steps (the global step if the graph
        has one, else runs that trained)."""
        initialized, trained, *_ = self._kind(fetched)
        if initialized and not self._restored and self._checkpoints is not None:
            self._restored = True
            latest = self._checkpoints.latest()
            if latest:
                self._saved = self._checkpoints.restore(self.session, latest)
                self._preemption.start = self._saved
                print(f"parallax_ng: restored step {self._saved} from {latest}",
                      file=sys.stderr, flush=True)
        if self.executor.ends_with_barrier(initialized, trained):
            self.executor.end_step(self.session)
        if trained and not self._told_trained:
            self._told_trained = True
            heartbeat.tell("trained", str(self._steps + 1 if self._saved is None
                                          else self._saved + 1))
        if trained and self._checkpoints is not None:
            self._steps += 1
            step = self._global_step()
            step = self._steps if step is None else step
            if step % self.config.checkpoint.every_steps == 0:
                self._save(step)
            if self._preemption.requested:
                self._stop_if_preempted(step)

    def _stop_if_preempted(self, step: int) -> None:
        """After a SIGTERM: at the step every worker stops at, save it and
        end the process (SystemExit 143, which unwinds the script: preemption.end)."""
        stop = self._preemption.stop_at(step)
        if stop is None or step < stop:
            return
        if step != self._saved:
            self._save(step)
        heartbeat.tell("preempted", str(step))
        print(f"parallax_ng: stopped at step {step} after SIGTERM, with a checkpoint of it",
              file=sys.stderr, flush=True)
        preemption.end()

    def _kind(self, fetched: tuple) -> tuple[bool, bool, bool, bool]:
        """(initializes variables, trains, reads an input queue, reaches a
        variable cut by columns) for a run of the user ops `fetched`."""
        if fetched not in self._kinds:
            tg = self.program.tg
            known = [f for f in fetched if f in tg.ir]
            late = [f for f in fetched if f in self.fetches.late]
            ancestors = tg.ir.ancestors(known)
            for name in late:   # ops made after get_runner: look at what they reach
                op = tg.user_graph.get_operation_by_name(name)
                ancestors |= tg.ir.ancestors(
                    [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs])
            inits = {v.initializer for v in tg.variables.values() if v.initializer}
            reads_queue = any(tg.ir.node(a).op.startswith(READ_PREFIXES) for a in ancestors)
            written = self.executor.written
            self._reached[fetched] = frozenset(ancestors)
            self._kinds[fetched] = (bool(ancestors & inits),
                                    bool(ancestors & self._training_writers), reads_queue,
                                    written is not None and bool(ancestors & written.reads))
        return self._kinds[fetched]

    @cached_property
    def _training_writers(self) -> frozenset[str]:
        return moves.training_writers(self.program.tg)

    def _global_step(self) -> int | None:
        return self._checkpoints.global_step(self.session)

