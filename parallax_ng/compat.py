"""TensorFlow internals parallax_ng relies on, in one place.

Each function names the public behaviour it stands for, so a TensorFlow
upgrade that moves an internal breaks here and nowhere else.
"""
from __future__ import annotations

import weakref
from functools import lru_cache

import tensorflow as tf


def indexed_slices_value(values, indices, dense_shape):
    """What a session gives for a fetched tf.IndexedSlices."""
    from tensorflow.python.framework.indexed_slices import IndexedSlicesValue
    return IndexedSlicesValue(values, indices, dense_shape)


@lru_cache(maxsize=None)
def ref_input_positions(op_type: str) -> tuple[bool, ...] | None:
    """For each input argument of `op_type`, whether it takes a reference
    (the op may write through it). None if the op is not registered."""
    from tensorflow.python.framework import op_def_registry
    op_def = op_def_registry.get(op_type)
    if op_def is None:
        return None
    return tuple(arg.is_ref for arg in op_def.input_arg)


@lru_cache(maxsize=None)
def outputs_ref(op_type: str) -> bool:
    """True if the op's first output is a reference (it forwards its input ref)."""
    from tensorflow.python.framework import op_def_registry
    op_def = op_def_registry.get(op_type)
    return bool(op_def and op_def.output_arg and op_def.output_arg[0].is_ref)


def dim(shape, i: int) -> int | None:
    """Dimension `i` of a shape as an int, or None if unknown.

    Under `tf.compat.v1.disable_v2_behavior()` (v1 TensorShape) indexing a
    shape gives a `Dimension` object, which is never `None` and cannot be
    divided by an int; this reads both kinds. A shape of unknown rank has no
    known dimension.
    """
    shape = tf.TensorShape(shape)
    if shape.rank is None:
        return None
    return tf.compat.dimension_value(shape[i])


def is_ref_dtype(dtype: tf.DType) -> bool:
    return dtype.base_dtype != dtype


def add_control_inputs(op: tf.Operation, deps: list) -> None:
    """Make `op` run after `deps` (ops already in its graph).

    tf.graph_util.import_graph_def cannot map control inputs onto existing
    ops with an empty import scope; TensorFlow's own graph editing uses this.
    """
    op._add_control_inputs(deps)  # noqa: SLF001


def output_dtypes(node_def, library=None) -> list[tuple[tf.DType, bool]] | None:
    """(dtype, is_reference) of every output of a NodeDef, from its op's
    registered signature (or its function's, for a call of a library
    function); None if the op is unknown."""
    from tensorflow.python.framework import op_def_registry
    op_def = op_def_registry.get(node_def.op)
    if op_def is None and library is not None:
        op_def = next((f.signature for f in library.function
                       if f.signature.name == node_def.op), None)
    if op_def is None:
        return None
    defaults = {a.name: a.default_value for a in op_def.attr if a.HasField("default_value")}

    def attr(name):
        return node_def.attr[name] if name in node_def.attr else defaults[name]

    out = []
    for arg in op_def.output_arg:
        if arg.type_list_attr:
            types = list(attr(arg.type_list_attr).list.type)
        else:
            one = attr(arg.type_attr).type if arg.type_attr else arg.type
            types = [one] * (attr(arg.number_attr).i if arg.number_attr else 1)
        out.extend((tf.as_dtype(t), arg.is_ref) for t in types)
    return out


# a graph's function bodies read as graphs, once per graph and function
_BODIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _definition(graph: tf.Graph, fn, name: str):
    """A library function's FunctionDef. `cached_definition` registers it
    with the eager context, which refuses a second, different definition of
    the name (a graph's copy whose function a pass rewrote): read that one
    from the graph's library instead."""
    try:
        return fn.cached_definition
    except tf.errors.InvalidArgumentError:
        return next(f for f in graph.as_graph_def().library.function
                    if f.signature.name == name)


def function_graph(graph: tf.Graph, name: str):
    """The graph of the function `name` of `graph`'s library (searched out
    through the graphs a function's graph is nested in), or None."""
    from tensorflow.python.framework import function_def_to_graph
    bodies = _BODIES.setdefault(graph, {})
    if name not in bodies:
        body, g = None, graph
        while body is None and g is not None:
            fn = g._get_function(name)      # noqa: SLF001 (the library's functions)
            if fn is not None:
                body = getattr(fn, "graph", None) or getattr(fn, "_cached_graph", None)
                if body is None:      # (with the functions it calls by name: a wrapper's)
                    with g.as_default():
                        body = function_def_to_graph.function_def_to_graph(
                            _definition(g, fn, name), include_library_functions=True)
            g = getattr(g, "outer_graph", None)
        bodies[name] = body
    return bodies[name]


def trace_level(target: str = "") -> int:
    """The RunOptions trace level of a run traced for its step stats (times,
    allocations) in a session on `target`: SOFTWARE_TRACE in this process
    (a direct session: the same stats, without the warning FULL_TRACE logs
    there on a CPU-only machine every run, "GPU trace was not collected"),
    FULL_TRACE where this process sees a GPU (its kernels' times too) or
    the session is a gRPC server's (whose workers keep no stats for less)."""
    options = tf.compat.v1.RunOptions
    return options.FULL_TRACE if target or _gpus() else options.SOFTWARE_TRACE


@lru_cache(maxsize=None)
def _gpus() -> bool:
    return bool(tf.config.list_physical_devices("GPU"))
