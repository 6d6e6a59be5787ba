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

import tensorflow as tf

from .errors import ConfigError, FetchError


class StepFunction:
    def __init__(self, fn, resource_info=None, config=None):
        if not callable(fn):
            raise ConfigError(f"pn.function takes the training step function, not a "
                              f"{type(fn).__name__}")
        self._fn, self._resources, self._config = fn, resource_info, config
        self.runner = None
        self._captured = None

    def __call__(self, *args, per_replica: bool = False):
        if self.runner is None:
            self._build(args)
        cap = self._captured
        leaves = tf.nest.flatten(args)
        if len(leaves) != len(cap.inputs):
            raise ConfigError(f"the step was traced with {len(cap.inputs)} batch tensors and "
                              f"is called with {len(leaves)}; call it as it was first called")
        feeds = {name + ":0": self._mine(_array(leaf)) for name, leaf in zip(cap.inputs, leaves)}
        if cap.outputs is None:          # the step returns nothing
            self.runner.run(cap.train, feeds)
            return None
        return self.runner.run([cap.train, cap.outputs], feeds, per_replica=per_replica)[1]

    def _mine(self, batch):
        """This worker's rows of a global batch (in a job, every worker is
        called with the global batch and takes its part)."""
        plan = self.runner.plan
        workers = getattr(plan, "num_workers", 1)
        if workers == 1:
            return batch
        rows = len(batch)
        if rows % workers:
            raise FetchError(f"a global batch of {rows} rows does not split evenly over the "
                             f"job's {workers} workers")
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

    def _build(self, args) -> None:
        from .build import get_runner
        from .graph.tracing import capture
        self._captured = cap = capture(self._fn, args)
        self.runner = get_runner(cap.graph, self._resources, self._config)
        self.runner.run(cap.init, cap.init_feeds)


def function(fn, resource_info=None, config=None) -> StepFunction:
    """`fn` as a data-parallel training step (module docstring)."""
    return StepFunction(fn, resource_info, config)


def _array(leaf):
    return leaf.numpy() if hasattr(leaf, "numpy") else leaf
