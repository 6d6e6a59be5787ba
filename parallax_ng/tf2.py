"""TF2 programs, data-parallel: `pn.function(fn)` for a custom training loop.

    step = pn.function(train_step, resource_info, config)
    for x, y in dataset:                   # global batches
        loss = step(x, y)                  # one synchronous step on every replica
    step.sync()                            # the trained values into the program's variables

Requires: `fn` (a Python function or a tf.function) runs one training step
on a batch: a loss under tf.GradientTape, its gradients applied by an
optimizer (Keras 3, tf_keras, or TensorFlow's), variables made before or
during its first trace, nothing else stateful outside TensorFlow.
Guarantees: the first call traces `fn` on the batch's shapes (the batch
dimension left open, and those its `input_signature` leaves open: step_args.py)
and rebuilds it as a training graph
(parallax_ng/graph/tracing.py), which takes the path every graph takes
(build.py: the plan the config asks for, the passes, one Runner); the
variables start from the program's values. A call with a global batch runs
one step on every replica (each takes its part of every argument, as a
feed is split; a batch the replica count does not divide, such as a
dataset's last, runs `fn` itself on the program's variables with the
runner's values, which then go back to the runner, in a run of one
process, and is an error in a job) and returns
`fn`'s outputs combined as `runner.run` combines fetches (a scalar's mean,
batch rows concatenated), or every replica's with `per_replica=True`. In a
job (`parallax-ng run`) every worker calls the step with the same global
batch and feeds its own rows (worker w of W: the w-th of W equal parts).
After each call the program's variables get the runner's values (config
`batch_sync`: "auto", all while they hold at most FOLLOWED bytes, else
those the step does not train, such as metrics' totals, and those another
step of the program reads or trains too), so a loop that
reads `metric.result()` or evaluates the model between calls sees what
one device would; `sync()` writes every trained value (optimizer slots
too) into the program's variables. A variable the step does not train that the program sets between
calls (a learning rate, a metric reset after a `sync`) is taken in at the
next call; trained weights the program sets go in by `push(variables)`.
`runner` is the Runner (its `plan`, `save`, checkpoints).
"""
from __future__ import annotations

import sys
import weakref

import numpy as np
import tensorflow as tf

from . import saving
from .errors import ConfigError, FetchError, GraphError
from .graph import accumulation
from .graph.frontend import NO_UPDATE
from .graph.recorders import tf_variable
from .runtime.batch_parts import sparse_rows
from .runtime.combining import name_outputs
from .step_args import (SparseValue, array, constants, fed, fits_shape, global_rows, kept_rows,
                        leaf_value, open_shapes, positional, rows_of, same_constants,
                        same_shapes, sparse_input, tensor_leaves, traced_shapes)

FOLLOWED = 4 << 20      # bytes of variables batch_sync "auto" writes back after every call
_STEPS: weakref.WeakSet = weakref.WeakSet()    # the process's built steps (shared weights)


class StepFunction:
    def __init__(self, fn, resource_info=None, config=None, parts=None, follow=True):
        """`parts`: args -> {name: (function, its args)}, functions traced
        with the step (on the first call's args) that `run_part` runs on the
        replicas (KerasFit's test_step and predict_step). `follow`: the
        program's variables get the runner's values after each call as the
        config's `batch_sync` says (pn.function; KerasFit syncs by itself)."""
        if not callable(fn):
            raise ConfigError(f"pn.function takes the training step function, not a "
                              f"{type(fn).__name__}")
        needs_eager("pn.function")
        saving.whole_saves_in_jobs()     # the program saves its own model, on every worker
        self._fn, self._resources, self._config = fn, resource_info, config
        self._parts = parts
        self.runner = None
        self._captured, self._constants = None, []    # (Python arguments traced as is)
        self._shapes: list = []          # the arguments' traced shapes (traced_shapes)
        self.open_shapes: dict = {}      # id(leaf) -> shape the trace leaves open (fit's data)
        self._pushes: dict = {}          # graph variable -> (placeholder, assign op)
        self._known: dict = {}           # watched graph variable -> the program's last value
        self._fresh: dict = {}           # trained ones the program got since the last step
        self.built: list = []            # called once the runner holds the variables
        self.on_program = 0              # batches that ran on the program's variables
        self._kept = frozenset()         # variables of per-example state (kept_rows)
        self._trained: set = set()       # the variables it trains, their slots too
        self._follow, self._followed = follow, None   # names written back after each call
        self.before_save = None          # what brings the program up to date before a save
        self.behind = False              # trained values the program does not have yet

    def __call__(self, *args, per_replica: bool = False, **kwargs):
        args = positional(self._fn, args, kwargs)   # step(x, y, training=True): by position
        if self.runner is None:
            self._build(args)
        cap = self._captured
        leaves = tensor_leaves(args)
        if len(leaves) != len(cap.inputs):
            raise ConfigError(f"the step was traced with {len(cap.inputs)} batch tensors and "
                              f"is called with {len(leaves)}; call it as it was first called")
        same_constants(self._constants, args)
        if not per_replica and self.alone() and not self.splits(args):
            return self._on_program(args)
        same_shapes(self._shapes, args)
        out = self._run(cap.train, cap.inputs, cap.outputs, leaves, per_replica)
        self._fresh = {}                 # the replicas trained past what the program has
        if self._follow:
            written = self._written_back() + self._read_elsewhere()
            if written:
                self._write_back(written)
            self.behind = len(set(written)) < len(cap.variables)
        return out

    def _read_elsewhere(self) -> list:
        """The variables this step trains but does not write back after each
        call that another step of the program reads (a GAN's discriminator,
        trained by one pn.function and read by the other's): written back,
        so the other takes them in before its next call."""
        if self._followed is None or len(self._followed) == len(self._captured.variables):
            return []
        watched = {id(tf_variable(other._captured.variables[name]))
                   for other in list(_STEPS) if other is not self for name in other._known}
        kept = set(self._followed)
        return [name for name, v in self._captured.variables.items()
                if name not in kept and id(tf_variable(v)) in watched]

    def _written_back(self) -> list:
        """What the program gets after each call (`batch_sync`): "auto",
        every variable while they hold at most FOLLOWED bytes, else those the
        step does not train (metrics' totals, counters, moving statistics)
        and those another step reads (`_read_elsewhere`), the others then
        at `sync()` (said once); "always" every one,
        "never" none. A custom loop reads metric.result() or evaluates the
        model between calls, as on one device."""
        if self._followed is None:
            mode, variables = self.runner.config.batch_sync, self._captured.variables
            size = sum(v.shape.num_elements() * v.dtype.size for v in map(tf_variable,
                                                                           variables.values()))
            every = mode == "always" or mode == "auto" and size <= FOLLOWED
            self._followed = [] if mode == "never" else list(variables) if every else \
                list(self._known)
            if not every and mode == "auto":
                print(f"parallax_ng: the step's variables hold {size / 2**20:.0f} MiB; the "
                      "program's get the trained weights at step.sync() and before a save "
                      "(a checkpoint, model.save or save_weights; config batch_sync: "
                      "always: after every call), its metrics' and other state, and weights "
                      "another pn.function step reads, after every call", file=sys.stderr,
                      flush=True)
        return self._followed

    def alone(self) -> bool:
        """Whether the runner is this process's alone, not a job's task."""
        from .cluster import from_env
        return from_env() is None and getattr(self.runner.plan, "num_workers", 1) == 1

    def _on_program(self, args):
        """A batch the replicas cannot split evenly (a dataset's last,
        smaller batch), in a run of one process: the step itself, one
        device's, on the program's variables holding the runner's values,
        which then go back into the runner."""
        self.sync()
        self.on_program += 1
        out = self._fn(*args)
        self.push(list(self._captured.variables.values()))
        return None if out is None else tf.nest.map_structure(array, out)

    def _run(self, op, inputs, outputs, leaves, per_replica):
        self._push_changed()
        feeds = {}
        for i, (name, leaf) in enumerate(zip(inputs, leaves)):
            feeds.update(self._feeds(i, name, leaf_value(leaf)))
        try:
            out = self.runner.run(op if outputs is None else [op, outputs], feeds,
                                  per_replica=per_replica)
        except tf.errors.InvalidArgumentError as e:     # (a constant global batch size?)
            raise global_rows(self._captured.graph, inputs, leaves,
                              self.runner.plan.group_size, e) from e
        return None if outputs is None else out[1]

    def fits(self, name: str, args) -> bool:
        """Whether part `name` (built with the step) takes `args`: the leaves
        it was traced with (dtype, shape past the batch dimension), and a
        batch every replica gets an equal part of."""
        if self.runner is None or name not in self._captured.parts:
            return False
        graph, inputs = self._captured.graph, self._captured.parts[name].inputs
        leaves = [leaf_value(leaf) for leaf in tensor_leaves(args)]
        if len(leaves) != len(inputs):
            return False
        for placeholder, leaf in zip(inputs, leaves):
            sparse = sparse_input(graph, placeholder)
            if sparse != isinstance(leaf, SparseValue):
                return False
            if sparse:
                t = graph.get_tensor_by_name(f"{placeholder}/values:0")
                if tf.as_dtype(leaf.values.dtype) != t.dtype or \
                        rows_of(leaf) % self.runner.plan.group_size:
                    return False
                continue
            t = graph.get_tensor_by_name(placeholder + ":0")
            if not fits_shape(t.shape, leaf) or tf.as_dtype(np.asarray(leaf).dtype) != t.dtype \
                    or np.ndim(leaf) and len(leaf) % self.runner.plan.group_size:
                return False
        return True

    def splits(self, args) -> bool:
        """Whether every replica gets an equal part of the global batch `args`."""
        n = self.runner.plan.group_size
        leaves = [leaf_value(leaf) for leaf in tensor_leaves(args)]
        return all(rows_of(leaf) % n == 0 for leaf in leaves      # (a scalar: not a batch,
                   if isinstance(leaf, SparseValue) or np.ndim(leaf))  # the feeds' error)

    def run_part(self, name: str, args, per_replica: bool = False):
        """Part `name` on the replicas, each on its part of the global batch
        `args` (`fits` says whether it can)."""
        part = self._captured.parts[name]
        return self._run(part.run, part.inputs, part.outputs, tensor_leaves(args),
                         per_replica)

    def _feeds(self, i: int, name: str, leaf) -> dict:
        """The feeds of argument leaf `i` (placeholder `name`): this worker's
        rows of it, a sparse batch's three tensors for a sparse placeholder."""
        sparse = sparse_input(self._captured.graph, name)
        if sparse != isinstance(leaf, SparseValue):
            kinds = ("a dense tensor", "a SparseTensor")
            raise ConfigError(f"argument leaf {i} of the step was traced as {kinds[sparse]} and "
                              f"is given {kinds[not sparse]}; call it as it was first called")
        return fed(name, self._mine(i, leaf))

    def _mine(self, i: int, batch):
        """This worker's rows of a global batch (in a job, every worker is
        called with the global batch and takes its part)."""
        plan = self.runner.plan
        if not isinstance(batch, SparseValue) and not np.ndim(batch):
            return batch                # a number every replica takes whole
        workers, rows = getattr(plan, "num_workers", 1), rows_of(batch)
        if rows % plan.group_size:
            raise FetchError(
                f"argument leaf {i} of the step holds a global batch of {rows} rows, which "
                f"does not split evenly over the job's {plan.group_size} replicas: use a "
                f"batch size that {plan.group_size} divides (with model.fit in a job of several "
                "workers, the last batch too: a dataset size it divides, "
                "drop_remainder=True or steps_per_epoch)")
        if workers == 1:
            return batch
        part = rows // workers
        if isinstance(batch, SparseValue):
            return SparseValue(*sparse_rows(*batch, plan.worker * part, part))
        return batch[plan.worker * part:(plan.worker + 1) * part]

    def sync(self, names=None) -> None:
        """The trained values into the program's variables (`names`' only),
        after those the program set since the last call (a callback's
        learning rate or `kernel.assign`, for the next call) went into the
        runner. Trained values it writes are watched to the next training call."""
        if self.runner is not None and names != []:
            self._push_changed()
            self._write_back(names, watch=True)

    def _write_back(self, names=None, watch: bool = False) -> None:
        cap = self._captured
        self.behind = self.behind and names is not None
        names = list(cap.variables) if names is None else names
        got = self.runner.run([cap.reads[n] for n in names])
        for i, name in enumerate(names):     # a replica's rows of per-example state
            if name in self._kept:
                got[i] = self.runner.run(cap.reads[name], per_replica=True)[0]
        for name, value in zip(names, got):
            cap.variables[name].assign(value)
            if name in self._known:
                self._known[name] = np.array(value, copy=True)
            elif watch:
                self._fresh[name] = value

    def _watch(self) -> None:
        """The variables the step does not train (a learning rate, a scale,
        a target network, metrics' totals, counters): what the program last
        had of each, so a value it sets between calls is seen. Trained
        weights and slots only from a `sync` or push to the next training
        call (`_fresh`): watched always, each call would copy the model;
        but those another step trains too always (`_watch_shared`)."""
        tg = self.runner.ctx.tg
        self._trained = {n for var in tg.gradients for n in tg.owned(var)}
        self._known = {name: np.array(array(v), copy=True)
                       for name, v in self._captured.variables.items()
                       if name not in self._trained}
        self._watch_shared()

    def _watch_shared(self) -> None:
        """Weights and slots another pn.function step trains too (one step
        trains the model, another fine-tunes its head): each of the two
        watches them, so what the other trained is taken in at its next
        call, and writes them back after each call (`_read_elsewhere`)."""
        mine = {id(tf_variable(self._captured.variables[n])): n for n in self._trained}
        for other in list(_STEPS):
            if other is self or other.runner is None or other.runner.closed:
                continue
            for name in other._trained:
                variable = other._captured.variables[name]
                if (ours := mine.get(id(tf_variable(variable)))) is not None:
                    for step, n in ((other, name), (self, ours)):
                        step._fresh.pop(n, None)
                        step._known[n] = np.array(array(variable), copy=True)

    def _push_changed(self) -> None:
        """Watched variables whose program value differs from what it last
        had (set between calls: `optimizer.learning_rate = ...`,
        `v.assign(...)`, a metric's `reset_state()` after a `sync`, a
        callback's `kernel.assign(...)`) into the runner."""
        variables = self._captured.variables
        changed = [variables[name] for watched in (self._known, self._fresh)
                   for name, known in watched.items()
                   if not np.array_equal(array(variables[name]), known)]
        if changed:
            self.push(changed)

    def push(self, variables) -> None:
        """The program's values of `variables` (tf.Variables or Keras
        variables the step uses) into the runner: after the program changed
        them (a callback, `set_weights`, a metric reset)."""
        if self.runner is None:
            return
        cap = self._captured
        names = {id(v): name for name, v in cap.variables.items()}
        ops, feeds = [], {}
        for v in variables:
            name = names.get(id(tf_variable(v)))
            if name is None:
                continue
            if name not in self._pushes:
                var = cap.variables[name]
                with cap.graph.as_default(), tf.compat.v1.name_scope("parallax_push/"):
                    value = tf.compat.v1.placeholder(var.dtype.base_dtype, var.shape)
                    op = tf.raw_ops.AssignVariableOp(
                        resource=cap.graph.get_tensor_by_name(name + ":0"), value=value)
                self._pushes[name] = (value.name, op.name)
            value, op = self._pushes[name]
            ops.append(op)
            feeds[value] = array(cap.variables[name])
            watched = self._known if name in self._known else self._fresh
            watched[name] = np.array(feeds[value], copy=True)
        if ops:
            self.runner.run(ops, feeds)

    def build(self, args) -> None:
        """Trace the step on `args` and make its runner, if not yet done."""
        if self.runner is None:
            self._build(args)

    def _build(self, args) -> None:
        from .build import Sample, get_runner
        from .graph.tracing import capture
        for other in list(_STEPS):      # the program's variables as the other steps left them
            other.sync()
        opened = {**open_shapes(getattr(self._fn, "input_signature", None), args),
                  **self.open_shapes}
        self._captured = cap = capture(self._fn, args, self._parts(args) if self._parts else
                                       None, opened)
        self._constants, self._shapes = constants(args), traced_shapes(cap.graph, cap.inputs)
        name_outputs(cap.graph, cap.outputs)
        try:
            batch = {}
            for name, leaf in zip(cap.inputs, tensor_leaves(args)):
                batch.update(fed(name, leaf_value(leaf)))
            sample = Sample(batch, cap.init_feeds)
            self.runner = get_runner(cap.graph, self._resources, self._config, sample)
        except GraphError as e:
            if not str(e).startswith(NO_UPDATE):
                raise
            if cap.jacobians:
                raise GraphError(
                    f"the step {getattr(self._fn, '__name__', self._fn)!r} updates its "
                    f"variables from tape.jacobian of {cap.jacobians[0]!r} (per-example "
                    "gradients, as DP-SGD takes them): parallax_ng finds a step's gradients "
                    "from tape.gradient calls, which a jacobian's loop hides; take the "
                    "update's gradients with tape.gradient") from None
            if cap.lost:
                raise GraphError(
                    f"the step {getattr(self._fn, '__name__', self._fn)!r} updates its "
                    f"variables from gradients of {cap.lost[0]!r} taken inside "
                    "tf.vectorized_map or tf.map_fn (per-example gradients, as DP-SGD takes "
                    "them): parallax_ng finds a step's gradients from tape.gradient calls, "
                    "which such a loop hides; take the update's gradients with tape.gradient "
                    "outside it") from None
            if held := accumulation.sinks(cap.graph):
                raise GraphError(
                    f"the step {getattr(self._fn, '__name__', self._fn)!r} adds its "
                    f"gradients into variables {held} and applies none: parallax_ng finds a "
                    "step's gradients from the update that applies them, in the same step "
                    "(each replica's sums stay its own until the update reads them). "
                    "Accumulate and apply in one step: apply every k calls under a tf.cond "
                    "(tf.cond(calls % k == 0, apply, lambda: tf.constant(False)), `calls` a "
                    "tf.Variable the step counts in), or take the k micro-batches' tapes "
                    "in one call") from None
            raise GraphError(
                f"the step {getattr(self._fn, '__name__', self._fn)!r} trains nothing: no "
                "trainable variable is written from a gradient. It must compute a loss "
                "under tf.GradientTape and apply the tape's gradients with an optimizer "
                "(optimizer.apply_gradients(zip(grads, variables))) in the step; parallax_ng "
                "finds the loss and the gradients from that update") from None
        self._kept = kept_rows(self.runner, args)
        self.runner.run(cap.init, cap.init_feeds)     # and restores `checkpoint.dir`'s latest
        self._watch()
        _STEPS.add(self)
        saving.synced_saves(_before_saves)
        saving.synced_restores(_before_saves, _after_restores)
        for hook in self.built:
            hook()


def _before_saves() -> None:
    """Before a save: every pn.function step's trained values in the
    program's variables (the program's own changes pushed first); a Keras
    fit's step as its KerasFit says (`before_save`)."""
    for step in list(_STEPS):
        if step.runner is None or step.runner.closed:
            continue
        if step.before_save is not None:
            step.before_save()
        elif step.behind:
            step.sync()


def _after_restores() -> None:
    """After a restore: every step's variables from the program's values
    (what the restore read, and what it left as the step had trained it)."""
    for step in list(_STEPS):
        if step.runner is not None and not step.runner.closed:
            step.push(list(step._captured.variables.values()))


def function(fn, resource_info=None, config=None) -> StepFunction:
    """`fn` as a data-parallel training step (module docstring)."""
    return StepFunction(fn, resource_info, config)


def needs_eager(what: str) -> None:
    """A ConfigError where TF2 behavior is off (tf.compat.v1.disable_v2_behavior()
    or disable_eager_execution() was called): TF2 entries trace and feed
    eager values, and tf_keras's v1 `fit` loop never reaches them."""
    if not tf.executing_eagerly():
        raise ConfigError(
            f"{what} needs TF2 behavior (eager execution), which is off here: the "
            "program called tf.compat.v1.disable_v2_behavior() or "
            "disable_eager_execution() (a Keras model then trains by TensorFlow 1's graph "
            "loop, which it does not reach), or it runs inside a graph's as_default(). "
            "Remove that, or write the step as a TF1 graph (the model called on the "
            "input tensors, a loss, a tf.compat.v1 optimizer's minimize) and give the "
            "graph to pn.get_runner")
