"""Keras `model.fit`, `evaluate` and `predict` data-parallel:
`pn.parallelize(model)` after `model.compile(...)`.

Requires: a compiled Keras 3 or tf_keras model; the batches Keras makes
are global batches.
Guarantees: `fit` keeps Keras's loop, callbacks, progress bar and history;
each step is the model's `train_step` as a data-parallel step (tf2.py's
StepFunction), traced on the first batch together with the model's
`test_step` and `predict_step` (`graph/tracing.py` parts), which
`evaluate` (and fit's validation) and `predict` run on the replicas, each
replica on its part of every batch, with the trained values in place.
A batch those cannot take (one the replica count does not divide, other
leaves than the first batch's), and `predict` in a job of several workers
(each worker holds only its replicas' rows), run on the model itself, with
the runner's values written into it first; so does a training batch the
replica count does not divide (a dataset's last) in a run of one process,
its trained values then written back into the runner. The model holds the runner's
values at every epoch's end, after `evaluate`, after every `train_on_batch`,
and after every batch while a callback that reads weights there is in the
fit (`reads_weights_per_batch`; config `batch_sync`); weights the program
sets on the model between calls are taken in when the next `fit`,
`train_on_batch`, `evaluate` or `predict` starts.
"""
from __future__ import annotations

import functools
import inspect
import warnings
from collections import Counter

import tensorflow as tf

from . import saving
from .errors import ConfigError
from .step_args import array, open_shapes
from .tf2 import StepFunction, needs_eager


class KerasFit:
    """The model's train, test and predict functions on one runner (module
    docstring). `behind`: steps ran since the model last got the runner's
    values; `on_model`: how many train, test and predict batches ran on the
    model itself."""

    def __init__(self, model, resource_info, config):
        self.model = model
        self._asked = (resource_info, config)
        self.callbacks_read = self.in_fit = False
        self.on_model = Counter()      # kind -> batches run on the model itself
        self._new_step()

    def _new_step(self) -> None:
        """A step to trace at the next call: the model's train step with its
        optimizer, loss and trainable variables as compiled now."""
        step = self.model.train_step        # as fit runs it: a tf.function, traced once
        self.step = StepFunction(step if self.model.run_eagerly else tf.function(step),
                                 *self._asked, self._parts, follow=False)
        self.step.built.append(self._metrics_reset)   # not a checkpoint's totals
        self.step.before_save = lambda: self.behind and self.sync()
        self._rate = None
        self.behind = False
        self._own = {}                 # kind -> the model's own tf.function of its step
        self._unbuilt = None           # tf_keras's compiled containers the train step left so
        self._tested = False           # a test batch ran (one device builds them then)

    def compile(self, compile, *args, **kwargs):
        """`model.compile` again (fine-tuning: layers unfrozen, a new
        optimizer): the model gets the trained values, and the next call
        traces the step anew and starts a runner from the model's values.
        In a job of several tasks (`parallax-ng run`, or Horovod's ranks),
        once a runner is running, a ConfigError."""
        if self.step.runner is not None:
            if not self.step.alone():
                raise ConfigError(
                    "model.compile after training began in a job of several tasks: the job's "
                    "step was built for the first compile's optimizer, loss and trainable "
                    "layers, and its tasks cannot start another together. Compile before "
                    "pn.parallelize, or train each phase as a job of its own (the second "
                    "loading the first one's saved weights)")
            if self.behind:
                self.sync()
            self.step.runner.close()
        out = compile(*args, **kwargs)
        self._new_step()
        return out

    def _parts(self, args) -> dict:
        data = args[0]
        x = data[0] if isinstance(data, (tuple, list)) else data
        def step(fn):      # as `evaluate` and `predict` run them, like the train step
            return fn if self.model.run_eagerly else tf.function(fn)
        return {"test": (step(self._noting(self.model.test_step)), args),
                "predict": (step(self._noting(self.model.predict_step)), ((x,),), "rows")}

    def _noting(self, fn):
        """`fn`, traced after the train step: its first trace notes which of
        tf_keras's compiled loss and metrics the train step left unbuilt (a
        custom train step that does not call them). The test step builds
        them; one device's fit does so only once it validates, and until
        then logs what the train step returns, not the metrics (`logs`)."""
        def traced(*args):
            if self._unbuilt is None:
                self._unbuilt = [c for c in (getattr(self.model, "compiled_loss", None),
                                             getattr(self.model, "compiled_metrics", None))
                                 if getattr(c, "_built", True) is False]
            return fn(*args)
        return traced

    def fit(self, fit, *args, **kwargs):
        """`model.fit`, the model written after every batch when one of its
        callbacks reads the weights there (`reads_weights_per_batch`; the
        config's `batch_sync`)."""
        given = inspect.signature(fit).bind_partial(*args, **kwargs).arguments
        callbacks = given.get("callbacks") or ()
        self.callbacks_read = any(reads_weights_per_batch(c) for c in callbacks)
        saving.backups_apart(callbacks)
        self.in_fit = True
        try:
            return fit(*args, **kwargs)
        finally:
            self.callbacks_read = self.in_fit = False

    def make_train_function(self, force: bool = False):
        """Keras 3 calls it and reads `train_function`; tf_keras uses what it returns."""
        self._current(self._model_variables() + self._optimizer_variables())
        self.model.train_function = self.train_function
        return self.train_function

    def make_test_function(self, force: bool = False):
        self._current(self._model_variables())
        self.model.test_function = self.test_function
        return self.test_function

    def make_predict_function(self, force: bool = False):
        self._current(self._model_variables())
        self.model.predict_function = self.predict_function
        return self.predict_function

    def _model_variables(self) -> list:
        """The model's variables; none before it is built (tf_keras's
        `variables` of a Sequential without an Input raises until its first
        batch builds it)."""
        return list(self.model.variables) if self.model.built else []

    def _current(self, variables) -> None:
        """Runner and model alike: the runner's values into the model if
        steps ran since it last had them, else the model's `variables`
        (the program may have set them) into the runner."""
        if self.behind:
            self.sync()
        else:
            self.step.push(variables)

    def sync(self) -> None:
        self.step.sync()
        self.behind = False

    def test_function(self, iterator):
        logs = None
        for data in self._batches(iterator):
            logs = self._run("test", data)
        return logs

    def predict_function(self, data):
        """Keras 3 gives a list of batches; tf_keras an iterator."""
        batches = self._batches(data) if hasattr(data, "__next__") else data
        outs = [self._run("predict", batch) for batch in batches]
        return tf.nest.map_structure(lambda *parts: tf.concat(parts, 0), *outs)

    def _batches(self, iterator) -> list:
        """The batches of one call (`steps_per_execution`); StopIteration,
        which ends Keras's loop, when the data ended before the first."""
        out = []
        for _ in range(self._steps_per_call()):
            try:
                out.append(next(iterator))
            except (StopIteration, tf.errors.OutOfRangeError):
                if not out:
                    raise StopIteration from None
                break
        return out

    def _run(self, kind: str, data):
        """A test or predict step on the replicas where it can run there,
        else on the model itself (a test step's metric totals carried
        over both ways)."""
        if self.step.runner is None:
            self.step.build((data,))
        self._tested = self._tested or kind == "test"
        plan = self.step.runner.plan
        jobwide = kind == "test" or getattr(plan, "num_workers", 1) == 1
        if jobwide and self.step.fits(kind, (data,)):
            self.behind = self.behind or kind == "test"
            return self.step.run_part(kind, (data,))
        if self.behind:
            self.sync()
        self.on_model[kind] += 1
        if kind not in self._own:
            self._own[kind] = tf.function(getattr(self.model, f"{kind}_step"))
        out = self._own[kind](data)
        if kind == "test":
            self._metrics_reset()
        return tf.nest.map_structure(array, out)

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
            if self.step.runner is None:    # traced as Keras traces it: on the data's spec
                self.step.open_shapes = open_shapes(getattr(iterator, "element_spec", None),
                                                    data)
            before = self.step.on_program
            logs = self.step(data)      # a batch the replicas cannot split: on the model
            self.behind = self.step.on_program == before
            if not self.behind:
                self.on_model["train"] += 1
        mode = self.step.runner.config.batch_sync      # a callback reads them, or the
        if mode == "always" or mode == "auto" and (self.callbacks_read or not self.in_fit):
            self.sync()                                 # program after train_on_batch
        return logs

    def _steps_per_call(self) -> int:
        """Batches Keras expects one call to take (`steps_per_execution`)."""
        spe = getattr(self.model, "_steps_per_execution", None)     # tf_keras: a variable
        if spe is None or isinstance(spe, int):
            spe = getattr(self.model, "steps_per_execution", 1)
        return max(int(array(spe) or 1), 1)

    def logs(self, keras_method: str):
        """Keras's `keras_method` (the logs of an epoch or an evaluation,
        from the metrics' totals) once the model holds the runner's values."""
        method = getattr(type(self.model), keras_method)

        def logs(logs):
            self.sync()
            hidden = [] if self._tested else [c for c in self._unbuilt or () if c._built]
            for container in hidden:    # as one device has them: not built yet
                container._built = False
            try:
                return method(self.model, logs)
            finally:
                for container in hidden:
                    container._built = True
        return logs

    def reset_metrics(self) -> None:
        type(self.model).reset_metrics(self.model)
        self._metrics_reset()

    def _metrics_reset(self) -> None:
        self.step.push([v for m in self.model.metrics for v in m.variables])

    def _optimizer_variables(self) -> list:
        made = getattr(self.model.optimizer, "variables", None) or []
        # tf_keras's legacy optimizers (OptimizerV2) have a method for them
        return list(made() if callable(made) else made)

    def _push_rate(self) -> None:
        """A learning rate a callback changed (LearningRateScheduler)."""
        rate = getattr(self.model.optimizer, "learning_rate", None)
        if not isinstance(rate, tf.Variable) and not hasattr(rate, "_value"):
            return
        value = float(array(rate))
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
    """`model.fit`, `evaluate` and `predict` data-parallel (after
    `model.compile(...)`): their batches are global batches, each replica
    takes its part. Returns the model."""
    needs_eager("pn.parallelize")
    if not getattr(model, "compiled", getattr(model, "_is_compiled", False)) or \
            getattr(model, "optimizer", None) is None:
        raise ConfigError("pn.parallelize takes a compiled model: call model.compile("
                          "optimizer=..., loss=...) first")
    stateful = [layer.name for layer in model._flatten_layers(include_self=False)
                if getattr(layer, "stateful", False) is True]
    if stateful:
        raise ConfigError(
            f"layers {stateful} are stateful: each keeps a state row per example of a "
            "fixed batch from batch to batch, and data parallelism gives each replica a "
            "part of every batch, which fit's model cannot follow. Build them with "
            "stateful=False (pass the state between batches as an input and an output), "
            "or train with a custom loop (pn.function) on a model built for one "
            "replica's part of the global batch")
    virtual = [layer.name for layer in model._flatten_layers(include_self=False)
               if getattr(layer, "virtual_batch_size", None)]
    if virtual:
        warnings.warn(
            f"BatchNormalization layers {virtual} have a virtual_batch_size: tf_keras "
            "groups a batch's rows into virtual batches strided across the whole batch "
            "(row i in group i mod batch/virtual_batch_size), so each replica's groups of "
            "its own rows are not one device's groups of the global batch, and the model "
            "trains apart from one device's (as under MultiWorkerMirroredStrategy). For the "
            "global batch's statistics, set synchronized=True and no virtual_batch_size",
            stacklevel=2)
    from .build import job_config
    if job_config(config).batch_norm == "synchronized":       # (the job's, as `fit` runs it)
        _synchronized(model)
    fit = KerasFit(model, resource_info, config)
    model.fit = functools.partial(fit.fit, type(model).fit.__get__(model))
    model.compile = functools.partial(fit.compile, type(model).compile.__get__(model))
    model.make_train_function = fit.make_train_function
    model.make_test_function = fit.make_test_function
    model.make_predict_function = fit.make_predict_function
    model.reset_metrics = fit.reset_metrics
    for name in ("_get_metrics_result_or_logs",                  # Keras 3
                 "_validate_and_get_metrics_result"):            # tf_keras
        if hasattr(type(model), name):
            setattr(model, name, fit.logs(name))
    saving.whole_saves_in_jobs()
    model.save = saving.whole_files(model.save)
    model.save_weights = saving.whole_files(model.save_weights)
    model._parallax_ng = fit
    return model


def _synchronized(model) -> None:
    """Config `batch_norm: synchronized`: every Keras 3 and tf_keras
    BatchNormalization layer of `model` normalizes by the global batch's
    statistics (its `synchronized` flag, which graph/replica_sums.py makes
    the job's sums), as one device does. A tf_keras layer built with the
    fused kernel (4-D and 5-D inputs) keeps it: the build lowers the kernel
    and exchanges its statistics (graph/fused_norm.py), and its moving
    variance stays the unbiased one the kernel reports, as on one device
    (tf_keras's synchronized statistics are unfused, and their moving
    variance the biased one)."""
    for layer in model._flatten_layers(include_self=False):
        if any(c.__name__ == "BatchNormalization" for c in type(layer).__mro__) and \
                hasattr(layer, "synchronized") and not layer.synchronized and \
                not getattr(layer, "fused", False):
            layer.synchronized = True
