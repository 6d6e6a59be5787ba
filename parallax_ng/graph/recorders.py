"""What a step's Python code does while it is traced (graph/tracing.py):
the slots Keras optimizers make, for which variable, and the tensors its
tapes differentiate; and, for slots made before (an optimizer built
before the step) or used by their handles alone, their owners by the
optimizers' naming (`owners_by_name`) and the variables of handles
(`unread_variables`). For a TF1 graph, what a tf.gradients call
differentiates, read from its seed (`seeded`).

Requires: Keras 3 or tf_keras optimizers (either may be missing), and
tf.GradientTape. Guarantees: each recorder patches a class method only
inside its `with` block and puts the original back, also on errors.
"""
from __future__ import annotations

import contextlib
import gc
import re

import tensorflow as tf

from .rules import is_autodiff

GRAD_YS = re.compile(r"(^|/)gradients(_\d+)?/grad_ys_\d+$")     # a tf.gradients call's seed
INPUT_GRADIENTS = "parallax_ng_input_gradients"   # a graph's collection of Targets.of_inputs
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


class Targets(list):
    """The training losses' names (the list), and `of_inputs`: (the target
    names, their seeds' names, (gradient, source) names) of each call
    whose sources are all tensors, not variables (an input's gradient:
    FGSM, a gradient penalty, a Jacobian), which trains nothing by itself.
    Such a call is given its seed, ones like each target, through an
    Identity named `SEED` (transforms/input_gradients.py scales it), and
    each gradient it returns goes through an Identity named `ROWS`: it has
    its source's rows (graph/rows.py reads them so), as a batch Jacobian
    has (noted without targets: its own calls are in its loop)."""

    def __init__(self):
        super().__init__()
        self.of_inputs = []
        self.jacobians = []         # targets of tape.jacobian calls of variables


SEED, ROWS = "parallax_ng_input_seed", "parallax_ng_input_gradient"
# a variable's gradient in a call also of inputs, whose seed the build scales
UNSCALED = "gradient_tape/parallax_ng_of_a_scaled_seed"


def note_input_gradients(graph: tf.Graph, calls: list) -> None:
    """Put `Targets.of_inputs` in `graph`'s collection (`input_gradients`
    and `input_rows` read them back)."""
    for targets, seeds, rows, *unscaled in calls:
        graph.add_to_collection(INPUT_GRADIENTS, "|".join(
            [",".join(targets), ",".join(seeds), ",".join(f"{g}={s}" for g, s in rows),
             ",".join(unscaled[0] if unscaled else [])]))


def _noted(graph: tf.Graph) -> list[list[list[str]]]:
    """[targets, seeds, "gradient=source" pairs, unscaled gradients] of each
    noted call, once."""
    return [[part.split(",") if part else [] for part in entry.split("|")]
            for entry in dict.fromkeys(graph.get_collection(INPUT_GRADIENTS))]


def input_gradients(graph: tf.Graph) -> list[tuple[list, list]]:
    """(target names, seed names) of the calls `note_input_gradients` noted."""
    return [(targets, seeds) for targets, seeds, *_ in _noted(graph)]


def gradients_of_inputs(graph: tf.Graph) -> list[tuple[list, list]]:
    """(seed names, [(gradient name, source name)]) of each noted call."""
    return [(seeds, [pair.split("=") for pair in rows]) for _, seeds, rows, _ in _noted(graph)]


def unscaled_gradients(graph: tf.Graph) -> list[tuple[list, list]]:
    """(seed names, names of the variables' gradients) of each noted call
    of variables and inputs together (`UNSCALED`)."""
    return [(seeds, unscaled) for _, seeds, _, unscaled in _noted(graph) if unscaled]


def input_rows(graph: tf.Graph) -> dict[str, tf.Tensor]:
    """{the op name of an input's gradient: its source} in `graph`."""
    out = {}
    for _, _, rows, _ in _noted(graph):
        for gradient, source in (pair.split("=") for pair in rows):
            try:
                out[gradient.split(":")[0]] = graph.get_tensor_by_name(source)
            except (KeyError, ValueError):      # not in the graph (a loop's body)
                pass
    return out


def _in_autodiff(result):
    """A tape's gradients of variables, each one that a custom gradient's
    function made (`tf.custom_gradient`'s `variables`: its ops are outside
    the tape's scope in a trace) passed through an Identity in that scope,
    so the build finds it as the variable's gradient."""
    return tf.nest.map_structure(
        lambda g: tf.identity(g, name="gradient_tape/of_a_custom_gradient")
        if isinstance(g, tf.Tensor) and not is_autodiff(g.op.name) else g, result)


@contextlib.contextmanager
def tape_targets():
    """The names of the tensors GradientTape.gradient is called on inside
    the block (a `Targets` list, filled as the calls come; the latest
    trace's). A call given `output_gradients` is a product with a gradient
    from elsewhere, not a loss's (tf.recompute_grad's gradient calls one)."""
    found = Targets()
    original, jacobian = tf.GradientTape.gradient, tf.GradientTape.batch_jacobian
    full = tf.GradientTape.jacobian

    def gradient(self, target, sources, output_gradients=None, *args, **kwargs):
        flat = tf.nest.flatten(target)
        if tf.executing_eagerly() or output_gradients is not None:
            return original(self, target, sources, output_gradients, *args, **kwargs)
        names = [t.name for t in flat if isinstance(t, tf.Tensor)]
        given = tf.nest.flatten(sources)
        tensors = [isinstance(s, tf.Tensor) for s in given]
        floating = len(names) == len(flat) and all(t.dtype.is_floating for t in flat)
        if floating and any(tensors) and not all(tensors):
            found.extend(names)                 # a loss, also of inputs (`[w, x]`)
            return of_both(self, target, sources, given, tensors, names, *args, **kwargs)
        if not all(tensors):
            found.extend(names)                 # a trace's loss
            return _in_autodiff(original(self, target, sources, output_gradients,
                                         *args, **kwargs))
        elif floating:
            seeds = [tf.identity(tf.ones_like(t), name=SEED) for t in flat]
            result = original(self, target, sources, tf.nest.pack_sequence_as(target, seeds),
                              *args, **kwargs)
            pairs = list(zip(tf.nest.flatten(sources), tf.nest.flatten(result)))
            leaves = [tf.identity(g, name=ROWS) if isinstance(g, tf.Tensor) else g
                      for _, g in pairs]
            found.of_inputs.append((names, [s.name for s in seeds], [
                (g.name, s.name) for (s, _), g in zip(pairs, leaves) if isinstance(g, tf.Tensor)]))
            return tf.nest.pack_sequence_as(result, leaves)
        return original(self, target, sources, output_gradients, *args, **kwargs)

    def of_both(self, target, sources, given, tensors, names, *args, **kwargs):
        """A call of variables and tensors (`tape.gradient(loss, [w, x])`):
        seeded as a call of inputs (the build scales the seed for a mean),
        each variable's gradient through an Identity named `UNSCALED`, which
        the build multiplies back, so the variables' gradients stay a
        replica's own."""
        flat = tf.nest.flatten(target)
        seeds = [tf.identity(tf.ones_like(t), name=SEED) for t in flat]
        result = original(self, target, given, tf.nest.pack_sequence_as(target, seeds),
                          *args, **kwargs)
        leaves, rows, unscaled = [], [], []
        for source, g, is_tensor in zip(given, result, tensors):
            if isinstance(g, tf.IndexedSlices) and not is_tensor:     # an embedding's rows
                values = tf.identity(g.values, name=UNSCALED)
                unscaled.append(values.name)
                g = tf.IndexedSlices(values, g.indices, g.dense_shape)
            elif isinstance(g, tf.Tensor):
                g = tf.identity(g, name=ROWS if is_tensor else UNSCALED)
                (rows.append((g.name, source.name)) if is_tensor else unscaled.append(g.name))
            leaves.append(g)
        found.of_inputs.append((names, [s.name for s in seeds], rows, unscaled))
        return tf.nest.pack_sequence_as(sources, leaves)

    def batch_jacobian(self, target, source, *args, **kwargs):
        result = jacobian(self, target, source, *args, **kwargs)
        if tf.executing_eagerly() or not isinstance(result, tf.Tensor) or \
                not isinstance(source, tf.Tensor):
            return result
        result = tf.identity(result, name=ROWS)     # a row per example of `source`
        found.of_inputs.append(([], [], [(result.name, source.name)]))
        return result
    def of_variables(self, target, sources, *args, **kwargs):     # (per-example gradients)
        if not all(isinstance(s, tf.Tensor) for s in tf.nest.flatten(sources)):
            found.jacobians.extend(t.name for t in tf.nest.flatten(target)
                                   if isinstance(t, tf.Tensor) and not tf.executing_eagerly())
        return full(self, target, sources, *args, **kwargs)
    tf.GradientTape.gradient, tf.GradientTape.batch_jacobian = gradient, batch_jacobian
    tf.GradientTape.jacobian = of_variables
    try:
        yield found
    finally:
        tf.GradientTape.gradient, tf.GradientTape.batch_jacobian = original, jacobian
        tf.GradientTape.jacobian = full


def owners_by_name(variables: list) -> dict:
    """Slots made before any capture saw them (an optimizer built before
    the first step: tf_keras's BackupAndRestore builds it, and so does a
    program that loads optimizer state): a Keras 3 optimizer names a slot
    `<optimizer>/<variable path with '_' for '/'>_<slot>`, tf_keras's
    `<slot>/<variable name>`, its legacy ones (OptimizerV2)
    `<optimizer>/<variable name>/<slot>` (`<variable name>/<slot>` when
    built outside `apply_gradients`); the longest such trainable variable
    of the same shape owns it."""
    trained = [v for v in variables if v.trainable]
    out = {}
    for v in variables:
        if v.trainable or "/" not in v.name:
            continue
        name = v.name.split(":")[0]
        leaf, stem = name.split("/", 1)[1], name.rsplit("/", 1)[0]
        middle = stem.split("/", 1)[1] if "/" in stem else None
        hits = [t for t in trained if t.shape == v.shape and (
                leaf.startswith(t.name.split(":")[0].replace("/", "_") + "_") or
                t.name.split(":")[0] in (leaf, stem, middle))]
        if hits:
            out[v.ref()] = max(hits, key=lambda t: len(t.name))
    return out


def unread_variables(handles: set) -> dict:
    """id(handle) -> the variable, for captured resource handles that are
    variables the trace used by their handle alone, never reading them, so
    that the function does not list them (tf_keras's legacy optimizers,
    OptimizerV2, give their slots to fused kernels such as
    ResourceApplyAdam that way): found among the live variables."""
    if not handles:
        return {}
    from tensorflow.python.ops.resource_variable_ops import BaseResourceVariable
    out = {}
    for obj in gc.get_objects():
        if isinstance(obj, BaseResourceVariable) and \
                id(getattr(obj, "_handle", None)) in handles:
            out[id(obj._handle)] = obj
    return out


def seeded(op: tf.Operation) -> list[tf.Tensor]:
    """What the tf.gradients call whose `grad_ys` fill is `op` differentiates:
    the input of the Shape the fill reads, or with a static shape the op the
    first gradient op is named for."""
    if op.inputs[0].op.type == "Shape":
        return [op.inputs[0].op.inputs[0]]
    scope, out = op.name[:op.name.rindex("/") + 1], []
    for c in op.outputs[0].consumers():
        rest = c.name[len(scope):] if c.name.startswith(scope) else ""
        head = rest.rsplit("_grad/", 1)[0] if "_grad/" in rest else None
        try:
            out.append(op.graph.get_operation_by_name(head).outputs[0])
        except (KeyError, ValueError, IndexError):
            pass
    return _added(list({t.name: t for t in out}.values()))


_PASSED = frozenset({"Add", "AddV2", "AddN", "Identity"})   # gradients through them: no op


def _added(terms: list) -> list:
    """The op that adds `terms` up, where there are several: the autodiff
    makes no op for an addition of scalars of one shape (it passes the
    gradient on), so a loss `a + b` seeds the gradients of a and b. The
    first op where all of them meet through additions; else `terms`."""
    if len(terms) < 2:
        return terms
    reach = {t.op: {i} for i, t in enumerate(terms)}
    stack = [t.op for t in terms]
    while stack:
        op = stack.pop()
        for c in {c for o in op.outputs for c in o.consumers() if c.type in _PASSED}:
            if not reach[op] <= reach.get(c, set()):
                reach[c] = reach.get(c, set()) | reach[op]
                stack.append(c)
    full = {op for op, got in reach.items() if len(got) == len(terms)}
    first = [op for op in full if not any(t.op in full for t in op.inputs)]
    return [first[0].outputs[0]] if len(first) == 1 else terms
