"""A TF2 step's arguments (tf2.py's `pn.function`, keras_fit.py's `fit`):
bound to the step's parameters by position, checked against what the step
was traced with, and fed.

Requires: the step's arguments as the program passes them (tensors,
arrays, SparseTensors, Python values). Guarantees: `positional` binds
keywords by position; `open_shapes` says which dimensions the trace leaves
open (those a tf.function's `input_signature` or a dataset's
`element_spec` leaves open, as a tf.function traces them: a padded batch's
length); `same_constants` and `same_shapes` give a ConfigError naming the
argument where a call differs from the trace in what a trace fixes;
`leaf_value` and `fed` make the feeds; `kept_rows` names the variables
that keep a row per example (checked against a replica's rows);
`global_rows` names, where a run fails on its shapes, what the step made
with the global batch's rows.
"""
from __future__ import annotations

import inspect

import numpy as np
import tensorflow as tf

from .errors import ConfigError, GraphError
from .graph.rules import is_autodiff
from .graph.step_specs import python_value, tensor_leaves
from .runtime.batch_parts import sparse_tensors

SparseValue = tf.compat.v1.SparseTensorValue


def array(leaf):
    return leaf.numpy() if hasattr(leaf, "numpy") else leaf


def positional(fn, args: tuple, kwargs: dict) -> tuple:
    """`fn`'s arguments, some given by keyword, in its parameters' order
    (defaults filled in): the step is traced and fed by position. The
    Python defaults after the last given argument are filled in too, traced
    values like any other (a later call that gives one another is refused,
    not run as traced), up to the first tensor or array default, which
    stays the function's own constant (not a batch to split). Without
    keywords, a signature that cannot be read or bound keeps `args`."""
    try:
        signature = inspect.signature(getattr(fn, "python_function", fn))
        bound = signature.bind(*args, **kwargs)
    except (TypeError, ValueError) as e:
        if not kwargs:
            return args
        raise ConfigError(f"the step's arguments do not fit its parameters: {e}") from None
    given = set(bound.arguments)
    bound.apply_defaults()
    if bound.kwargs:
        if not kwargs:
            return args
        raise ConfigError(f"the step takes {sorted(bound.kwargs)} by keyword only; give them "
                          "by position (make them positional parameters)")
    names = [p.name for p in signature.parameters.values() if p.kind in (
        p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(names) != len(bound.args):           # a *args parameter: every one was given
        return bound.args
    last = max([i for i, name in enumerate(names) if name in given], default=-1)
    cut = next((i for i, name in enumerate(names) if i > last and
                not python_value(bound.args[i])), len(names))
    return tuple(bound.args[:cut])


def open_shapes(specs, args) -> dict:
    """id(leaf) -> the TensorShape whose None dimensions the trace leaves
    open, for each leaf of `args` that `specs` (a structure of TensorSpecs
    like `args`': an input_signature, a dataset's element_spec) gives a
    shape of its rank; {} where the structures do not match."""
    flat, given = tf.nest.flatten(args), tf.nest.flatten(specs) if specs is not None else []
    if len(flat) != len(given):
        return {}
    return {id(leaf): spec.shape for leaf, spec in zip(flat, given)
            if isinstance(spec, tf.TensorSpec) and spec.shape.rank is not None and
            spec.shape.rank == np.ndim(leaf)}


def constants(args) -> list:
    """The step's arguments traced as constants (Python numbers, strings)."""
    return [(i, a) for i, a in enumerate(tf.nest.flatten(args)) if python_value(a)]


def same_constants(traced: list, args) -> None:
    """A ConfigError where a call gives a Python argument another value than
    the step was traced with (a tf.function would trace it again)."""
    flat = tf.nest.flatten(args)
    for i, value in traced:
        if i >= len(flat) or type(flat[i]) is not type(value) or flat[i] != value:
            given = flat[i] if i < len(flat) else "nothing"
            raise ConfigError(
                f"argument leaf {i} of the step was the Python value {value!r} when the step "
                f"was traced and is now {given!r}: the step is traced once, with Python "
                "values as constants. Pass a value that changes from call to call as a "
                f"tensor (tf.constant({given!r})), which every replica gets whole")


def traced_shapes(graph: tf.Graph, inputs: list) -> list:
    """The shapes past the batch dimension of the step's dense argument
    placeholders (None for a sparse one), as `same_shapes` reads them."""
    return [None if sparse_input(graph, name) else
            graph.get_tensor_by_name(name + ":0").shape for name in inputs]


def fits_shape(shape: tf.TensorShape, leaf) -> bool:
    """Whether `leaf` (a batch or a scalar) fits a placeholder of `shape`:
    its rank, and every dimension past the first the trace fixed."""
    if np.ndim(leaf) != shape.rank:
        return False
    return all(d is None or d == n for d, n in zip(shape.as_list()[1:], np.shape(leaf)[1:]))


def same_shapes(traced: list, args) -> None:
    """A ConfigError where a call's argument has another shape past its batch
    dimension than the trace fixed (a padded batch of another length)."""
    for i, (shape, leaf) in enumerate(zip(traced, tensor_leaves(args))):
        if shape is None or isinstance(leaf, (tf.SparseTensor, SparseValue, tf.RaggedTensor)) or \
                fits_shape(shape, leaf):
            continue
        raise ConfigError(
            f"argument leaf {i} of the step has shape {list(np.shape(leaf))}, and the step "
            f"was traced for {shape.as_list()} (None: any): the step is traced once. Give "
            "the dimensions that vary from batch to batch as None: pass a tf.function with "
            "an input_signature (tf.TensorSpec([None, None], ...)), or pad every batch to "
            "one length")


def leaf_value(leaf):
    """A step argument's leaf as fed: an array, or a SparseTensorValue of
    arrays for a SparseTensor (a batch of sparse rows) or a RaggedTensor
    (rows of several lengths, which the traced step makes ragged again)."""
    if isinstance(leaf, tf.RaggedTensor):
        leaf = leaf.to_sparse()
    if isinstance(leaf, (tf.SparseTensor, SparseValue)):
        return SparseValue(*(np.asarray(array(t)) for t in
                             (leaf.indices, leaf.values, leaf.dense_shape)))
    return array(leaf)


def fed(name: str, leaf) -> dict:
    """The feeds of argument placeholder `name` given `leaf`: its tensor, or
    a sparse placeholder's three tensors for a SparseTensorValue."""
    if isinstance(leaf, SparseValue):
        return dict(zip(sparse_tensors(name), leaf))
    return {name + ":0": leaf}


def rows_of(leaf) -> int:
    return int(leaf.dense_shape[0]) if isinstance(leaf, SparseValue) else len(leaf)


def sparse_input(graph: tf.Graph, name: str) -> bool:
    """Whether argument placeholder `name` is a sparse placeholder's."""
    try:
        graph.get_operation_by_name(name + "/indices")
    except KeyError:
        return False
    return True


def kept_rows(runner, args) -> frozenset:
    """The variables the step writes with rows of its batch's examples (a
    stateful RNN's state, kept from batch to batch): each replica keeps its
    own examples' rows, which is one device's state where the model is
    built for a replica's part of the global batch; a ConfigError where
    they hold another number of rows."""
    from .pipeline.results import PerExampleState
    state = runner.ctx.result(PerExampleState) if hasattr(runner, "ctx") else None
    if state is None:
        return frozenset()
    leaves = [leaf for leaf in map(leaf_value, tensor_leaves(args))
              if isinstance(leaf, SparseValue) or np.ndim(leaf)]     # batches
    n = runner.plan.group_size
    part = rows_of(leaves[0]) // n if leaves else None
    for var, axis in state.axes:
        shape = tf.TensorShape(runner.ctx.tg.ir.node(var).attr["shape"].shape)
        held = tf.compat.dimension_value(shape[axis]) if shape.rank else None
        if held != part:
            raise ConfigError(
                f"variable {var!r} keeps a row per example of a batch of {held} from "
                f"batch to batch (a stateful RNN's state), and each of the {n} replicas "
                f"takes {part} rows of the global batch: build the model for {part} rows "
                f"(keras.Input(batch_shape=({part}, ...))), so that each replica keeps its "
                "own examples' state, or build the layer with stateful=False")
    return frozenset(var for var, _ in state.axes)


def global_rows(graph: tf.Graph, inputs: list, leaves, replicas: int, error) -> Exception:
    """A GraphError for `error`, a run's InvalidArgumentError on shapes, naming the
    tensors the step makes with the global batch's rows from neither its
    arguments nor its variables (`tf.zeros((BATCH, units))`, an RNN's first
    state; `tf.random.normal([BATCH, noise])`, a GAN's noise): each replica
    gets 1/`replicas` of the arguments' rows, which they do not meet
    (`inputs`: the arguments' placeholders); `error` itself where there is
    none."""
    rows = {int(np.shape(leaf_value(x))[0]) for x in leaves if np.ndim(leaf_value(x))}
    shapes = ("shape", "Incompatible", "Dimension", "assertion failed")   # (not a NaN check's)
    if replicas < 2 or len(rows) != 1 or (batch := rows.pop()) < 2 or \
            not any(word in (error.message or "") for word in shapes):
        return error
    fed = set(inputs)
    tied = {op.name for op in graph.get_operations() if op.name in fed or op.type in (
        "VarHandleOp", "VariableV2", "ReadVariableOp", "Placeholder")}
    made = []
    for op in graph.get_operations():       # (in the order the step made them)
        if op.name in tied or any(x.op.name in tied for x in op.inputs) or \
                any(c.name in tied for c in op.control_inputs):
            tied.add(op.name)
            continue
        shape = op.outputs[0].shape if op.outputs else tf.TensorShape(None)
        uses = [c.type for c in op.outputs[0].consumers()] if op.outputs else []
        if shape.rank and shape[0] == batch and op.outputs[0].dtype.is_floating and \
                not is_autodiff(op.name) and set(uses) - {"Assign", "AssignVariableOp"} and \
                not any(x.shape.rank and x.shape[0] == batch for x in op.inputs):
            made.append(f"{op.name!r} {shape.as_list()}")
    if not made:
        return error
    said = [line.strip() for line in (error.message or "").splitlines()
            if "INVALID_ARGUMENT" in line] or [str(error).splitlines()[0]]
    return GraphError(
        f"{said[0].removeprefix('(0) ')}; the step makes "
        f"{', '.join(made[:3])} with the global batch's {batch} rows, and each of the "
        f"{replicas} replicas gets {batch // replicas} rows of the arguments; size it by "
        "the arguments' rows, tf.shape(x)[0] (a constant batch size is the global batch's)")
