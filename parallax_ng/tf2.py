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
dimension left open) and rebuilds it as a training graph
(parallax_ng/graph/tracing.py), which takes the path every graph takes
(build.py: the plan the config asks for, the passes, one Runner); the
variables start from the program's values. A call with a global batch runs
one step on every replica (each takes its part of every argument, as a
feed is split: the batch must divide by the replica count) and returns
`fn`'s outputs combined as `runner.run` combines fetches (a scalar's mean,
batch rows concatenated), or every replica's with `per_replica=True`. In a
job (`parallax-ng run`) every worker calls the step with the same global
batch and feeds its own rows (worker w of W: the w-th of W equal parts).
`sync()` writes the variables' trained values (optimizer slots too) into
the program's variables, so the model, `model.save` and eager code see
them. `runner` is the Runner (its `plan`, `save`, checkpoints).
"""
from __future__ import annotations

import functools

import tensorflow as tf

from .errors import ConfigError, FetchError, GraphError
from .graph.frontend import NO_UPDATE
from .graph.tracing import tf_variable


class StepFunction:
    def __init__(self, fn, resource_info=None, config=None):
        if not callable(fn):
            raise ConfigError(f"pn.function takes the training step function, not a "
                              f"{type(fn).__name__}")
        self._fn, self._resources, self._config = fn, resource_info, config
        self.runner = None
        self._captured = None
        self._pushes: dict = {}          # graph variable -> (placeholder, assign op)
        self.built: list = []            # called once the runner holds the variables

    def __call__(self, *args, per_replica: bool = False):
        if self.runner is None:
            self._build(args)
        cap = self._captured
        leaves = tf.nest.flatten(args)
        if len(leaves) != len(cap.inputs):
            raise ConfigError(f"the step was traced with {len(cap.inputs)} batch tensors and "
                              f"is called with {len(leaves)}; call it as it was first called")
        feeds = {name + ":0": self._mine(i, _array(leaf))
                 for i, (name, leaf) in enumerate(zip(cap.inputs, leaves))}
        if cap.outputs is None:          # the step returns nothing
            self.runner.run(cap.train, feeds)
            return None
        return self.runner.run([cap.train, cap.outputs], feeds, per_replica=per_replica)[1]

    def _mine(self, i: int, batch):
        """This worker's rows of a global batch (in a job, every worker is
        called with the global batch and takes its part)."""
        plan = self.runner.plan
        workers, rows = getattr(plan, "num_workers", 1), len(batch)
        if rows % plan.group_size:
            raise FetchError(
                f"argument leaf {i} of the step holds a global batch of {rows} rows, which "
                f"does not split evenly over the job's {plan.group_size} replicas: use a "
                f"batch size that {plan.group_size} divides (with model.fit, the last batch "
                "too: a dataset size it divides, drop_remainder=True or steps_per_epoch)")
        if workers == 1:
            return batch
        part = rows // workers
        return batch[plan.worker * part:(plan.worker + 1) * part]

    def sync(self) -> None:
        """The trained values into the program's variables."""
        if self.runner is None:
            return
        cap = self._captured
        names = list(cap.variables)
        got = self.runner.run([cap.reads[n] for n in names])
        for name, value in zip(names, got):
            cap.variables[name].assign(value)

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
            feeds[value] = _array(cap.variables[name])
        if ops:
            self.runner.run(ops, feeds)

    def _build(self, args) -> None:
        from .build import Sample, get_runner
        from .graph.tracing import capture
        self._captured = cap = capture(self._fn, args)
        try:
            sample = Sample({name + ":0": _array(leaf)
                             for name, leaf in zip(cap.inputs, tf.nest.flatten(args))},
                            cap.init_feeds)
            self.runner = get_runner(cap.graph, self._resources, self._config, sample)
        except GraphError as e:
            if not str(e).startswith(NO_UPDATE):
                raise
            raise GraphError(
                f"the step {getattr(self._fn, '__name__', self._fn)!r} trains nothing: no "
                "trainable variable is written from a gradient. It must compute a loss "
                "under tf.GradientTape and apply the tape's gradients with an optimizer "
                "(optimizer.apply_gradients(zip(grads, variables))) in the step; parallax_ng "
                "finds the loss and the gradients from that update") from None
        try:
            _check_sparse_updates(cap.optimizers, self.runner.ctx.tg)
        except ConfigError:
            self.runner.close()
            self.runner = None
            raise
        self.runner.run(cap.init, cap.init_feeds)     # and restores `checkpoint.dir`'s latest
        for hook in self.built:
            hook()


# Keras 3 optimizers whose update of a sparse (embedding) gradient equals one
# device's under parallax_ng's methods (tests/test_tf2.py). Others may make
# math of the rows that the replicas' rows do not reproduce (Adafactor's
# factored moments do not); tf_keras's sum duplicate rows first, as TF1's do.
SPARSE_KNOWN = ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Nadam", "Adamax", "Lion",
                "Ftrl", "Lamb", "Adadelta")


def _check_sparse_updates(classes, tg) -> None:
    """Refuse a Keras 3 optimizer not in SPARSE_KNOWN on a sparse gradient."""
    sparse = sorted(v for v, g in tg.gradients.items() if g.sparse)
    unknown = sorted({c.__name__ for c in classes if c.__module__.startswith("keras.")
                      and c.__name__ not in SPARSE_KNOWN})
    if sparse and unknown:
        raise ConfigError(
            f"Keras 3 optimizer {unknown[0]} updates the sparse gradient of {sparse[:3]} "
            "(an embedding's rows) with math parallax_ng does not know to give one "
            f"device's result from the replicas' rows; it knows {', '.join(SPARSE_KNOWN)} "
            "(and tf_keras's optimizers) there. Use one of those, or give the table a "
            "dense gradient")


def function(fn, resource_info=None, config=None) -> StepFunction:
    """`fn` as a data-parallel training step (module docstring)."""
    return StepFunction(fn, resource_info, config)


def _array(leaf):
    return leaf.numpy() if hasattr(leaf, "numpy") else leaf


class KerasFit:
    """`model.fit` on the runner: Keras's loop, callbacks and progress bar
    as they are, each step (`train_function`) a data-parallel step of the
    model's `train_step`; the program's variables written back at the end
    of every epoch (before validation and the epoch's callbacks) and read
    again at the start of every `fit` and after a metric reset."""

    def __init__(self, model, resource_info, config):
        self.model = model
        self.step = StepFunction(model.train_step, resource_info, config)
        self.step.built.append(self._metrics_reset)   # not a checkpoint's totals
        self._rate = None
        self.batch_sync = False

    def fit(self, fit, *args, **kwargs):
        """`model.fit`, the model written after every batch when one of its
        callbacks reads the weights there (`reads_weights_per_batch`)."""
        import inspect
        given = inspect.signature(fit).bind_partial(*args, **kwargs).arguments
        self.batch_sync = any(reads_weights_per_batch(c) for c in given.get("callbacks") or ())
        try:
            return fit(*args, **kwargs)
        finally:
            self.batch_sync = False

    def make_train_function(self, force: bool = False):
        """Keras 3 calls it and reads `train_function`; tf_keras uses what it returns."""
        self.step.push(self.model.variables + self._optimizer_variables())
        self.model.train_function = self.train_function
        return self.train_function

    def train_function(self, iterator):
        logs = None
        for k in range(self._steps_per_call()):
            try:
                data = next(iterator)
            except (StopIteration, tf.errors.OutOfRangeError):
                if k == 0:
                    raise StopIteration from None
                break
            self._push_rate()
            logs = self.step(data)
        if self.batch_sync:           # a callback reads the weights after every batch
            self.step.sync()
        return logs

    def _steps_per_call(self) -> int:
        """Batches Keras expects one call to take (`steps_per_execution`)."""
        spe = getattr(self.model, "_steps_per_execution", None)     # tf_keras: a variable
        if spe is None or isinstance(spe, int):
            spe = getattr(self.model, "steps_per_execution", 1)
        return max(int(_array(spe) or 1), 1)

    def epoch_logs(self, logs):
        """The step's logs (cumulative, as Keras's metrics are) once the
        program holds the trained values."""
        self.step.sync()
        return logs

    def reset_metrics(self) -> None:
        type(self.model).reset_metrics(self.model)
        self._metrics_reset()

    def _metrics_reset(self) -> None:
        self.step.push([v for m in self.model.metrics for v in m.variables])

    def _optimizer_variables(self) -> list:
        opt = self.model.optimizer
        return list(getattr(opt, "variables", []) or [])

    def _push_rate(self) -> None:
        """A learning rate a callback changed (LearningRateScheduler)."""
        rate = getattr(self.model.optimizer, "learning_rate", None)
        if not isinstance(rate, tf.Variable) and not hasattr(rate, "_value"):
            return
        value = float(_array(rate))
        if value != self._rate:
            self.step.push([rate])
            self._rate = value


# Keras's own callbacks that read the model's weights at batch ends when
# saving every `save_freq` batches (others there read only the logs).
SAVING = ("ModelCheckpoint", "BackupAndRestore", "OrbaxCheckpoint",
          "SidecarEvaluatorModelExport")
BATCH_HOOKS = ("on_train_batch_begin", "on_train_batch_end", "on_batch_begin", "on_batch_end")


def reads_weights_per_batch(callback) -> bool:
    """Whether `callback` may read the model's weights between a fit's
    batches: Keras's savers with an integer `save_freq`, a LambdaCallback
    given a batch hook, and any other class of the program's that
    overrides a batch hook (Keras's ProgbarLogger, TensorBoard,
    TerminateOnNaN, ... read only the logs)."""
    cls = type(callback)
    if cls.__module__.split(".")[0] not in ("keras", "tf_keras"):
        base = next((c for c in cls.__mro__ if c.__name__ == "Callback" and
                     c.__module__.split(".")[0] in ("keras", "tf_keras")), object)
        return any(getattr(cls, h, None) is not getattr(base, h, None) for h in BATCH_HOOKS)
    if cls.__name__ == "LambdaCallback":
        return any(h in vars(callback) for h in BATCH_HOOKS)
    return any(c.__name__ in SAVING for c in cls.__mro__) and \
        isinstance(getattr(callback, "save_freq", "epoch"), int)


def parallelize(model, resource_info=None, config=None):
    """`model.fit` data-parallel (after `model.compile(...)`): its batches are
    global batches, each replica takes its part. Returns the model."""
    if not getattr(model, "compiled", getattr(model, "_is_compiled", False)) or \
            getattr(model, "optimizer", None) is None:
        raise ConfigError("pn.parallelize takes a compiled model: call model.compile("
                          "optimizer=..., loss=...) first")
    fit = KerasFit(model, resource_info, config)
    model.fit = functools.partial(fit.fit, type(model).fit.__get__(model))
    model.make_train_function = fit.make_train_function
    model.reset_metrics = fit.reset_metrics
    model._get_metrics_result_or_logs = fit.epoch_logs          # Keras 3
    model._validate_and_get_metrics_result = fit.epoch_logs     # tf_keras
    model._parallax_ng = fit
    return model
