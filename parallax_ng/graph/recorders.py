"""What a step's Python code does while it is traced (graph/tracing.py):
the slots Keras optimizers make, for which variable, and the tensors its
tapes differentiate.

Requires: Keras 3 or tf_keras optimizers (either may be missing), and
tf.GradientTape. Guarantees: each recorder patches a class method only
inside its `with` block and puts the original back, also on errors.
"""
from __future__ import annotations

import contextlib

import tensorflow as tf

OWNERS: dict = {}      # slot's tf.Variable .ref() -> its variable, every slot seen being made


@contextlib.contextmanager
def slots_recorded():
    """Record (slot -> variable) as Keras optimizers make slots (kept for
    later captures of the same program)."""
    owners = OWNERS
    patched = []
    for cls in optimizer_classes():
        original = cls.add_variable_from_reference

        def recording(self, reference_variable, *a, _original=original, **kw):
            slot = _original(self, reference_variable, *a, **kw)
            owners[tf_variable(slot).ref()] = tf_variable(reference_variable)
            return slot

        cls.add_variable_from_reference = recording
        patched.append((cls, original))
    try:
        yield owners
    finally:
        for cls, original in patched:
            cls.add_variable_from_reference = original


def optimizer_classes() -> list:
    out = []
    try:
        from keras.src.optimizers.base_optimizer import BaseOptimizer
        out.append(BaseOptimizer)
    except ImportError:
        pass
    try:
        from tf_keras.src.optimizers.optimizer import _BaseOptimizer
        out.append(_BaseOptimizer)
    except ImportError:
        pass
    return out


def tf_variable(v):
    """The tf.Variable of a Keras 3 variable, or of tf_keras's
    AutoCastVariable (a mixed-precision policy's weights and metric
    totals: a tf.Variable wrapping one); a tf.Variable itself otherwise."""
    if not isinstance(v, tf.Variable):
        return getattr(v, "_value", v)
    inner = getattr(v, "_variable", None)
    return inner if isinstance(inner, tf.Variable) else v


@contextlib.contextmanager
def tape_targets():
    """The names of the tensors GradientTape.gradient is called on inside
    the block (a list, filled as the calls come; the latest trace's). A
    call given `output_gradients` is a product with a gradient from
    elsewhere, not a loss's (tf.recompute_grad's gradient calls one)."""
    found = []
    original = tf.GradientTape.gradient

    def gradient(self, target, *args, **kwargs):
        seeded = kwargs.get("output_gradients", args[1] if len(args) > 1 else None)
        if not tf.executing_eagerly() and seeded is None:   # a trace's loss
            found.extend(t.name for t in tf.nest.flatten(target) if isinstance(t, tf.Tensor))
        return original(self, target, *args, **kwargs)
    tf.GradientTape.gradient = gradient
    try:
        yield found
    finally:
        tf.GradientTape.gradient = original
