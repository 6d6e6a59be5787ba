"""TF2 steps as training graphs: a step function (a Python function or a
tf.function that computes a loss under tf.GradientTape and applies its
gradients with an optimizer) traced once and rebuilt as a tf.compat.v1
graph, which the front end, the planner and the passes take as they take a
TF1 graph (docs/tf2-capture.md has the facts this relies on).

Requires: `capture(fn, args)`: `fn(*args)` runs one training step on the
batch `args` (tensors or arrays, nested); every variable it uses exists
once it has been traced (an optimizer's slots are made during the trace
and given their starting values here).
Guarantees: a `Captured` whose `graph` holds
- a resource variable per variable the step reads or writes, under its
  Keras path or tf.Variable name (made unique), trainable as the program's,
  whose initializer assigns its value at capture (fed by `init_feeds`, not
  stored in the graph); a Keras optimizer slot is colocated with its
  variable (the front end's owner);
- a Placeholder per leaf of `args` (`inputs`, in order), its first
  dimension unknown, so the runner splits a global batch over the replicas
  (a SparseTensor's: a `sparse_placeholder`, split by its rows);
- the step's ops, calls inlined and tf.cond / while_loop lowered
  (Switch/Merge), names as traced (GradientTape's `gradient_tape/`);
- `outputs`: fn's return value as tensor names, in its structure; `train`:
  an op that runs the whole step (every stateful op of the trace);
- with `parts` ({name: (function, args)}, e.g. Keras's test_step and
  predict_step), each function traced on its own and imported beside the
  step under the scope `parallax_part_<name>`, with its own placeholders
  (numbered after the step's), outputs and run op (`Captured.parts`),
  sharing the step's variables; a part whose trace fails is left out
  (`Captured.failed` says why); one given as (function, args, "rows")
  returns rows Keras joins (predict_step): in `forms.JOINED_ROWS`.
`variables` maps each graph variable to the program's tf.Variable;
A tensor the step captures (a NumPy array in its closure) becomes a
constant; a lookup table it reads, a table of the same entries filled by
the initializer (graph/tables.py). A step that needs what cannot be rebuilt
(another resource, an argument that is not a batch) or that traces only
with a known batch size is a GraphError naming it.
"""
from __future__ import annotations

import contextlib
import re
from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import tensorflow as tf

from ..errors import GraphError
from . import forms, inlining, recorders
from . import tables as lookup
from .row_divisions import row_divisions
from .row_updates import row_reads, row_updates
from .step_specs import INPUT, python_value, spec, tensor_leaves  # noqa: F401 (INPUT: here too)

PART = "parallax_part_{}"           # the name scope of a part's ops (`capture`'s parts)


@dataclass
class Part:
    """A function traced beside the step (`capture`'s parts: Keras's
    test_step and predict_step), run by its own op on its own inputs."""
    inputs: list[str]                  # placeholder names, in the order of its args' leaves
    outputs: object                    # its return structure, tensor names as leaves
    run: str                           # op that runs it (its outputs and stateful ops)


@dataclass
class Captured:
    graph: tf.Graph
    inputs: list[str]                  # placeholder names, in the order of args' leaves
    outputs: object                    # fn's return structure, tensor names as leaves
    train: str                         # op that runs the step
    variables: dict                    # graph variable name -> the program's tf.Variable
    reads: dict                        # graph variable name -> a tensor reading it
    init: str                          # op that initializes every variable
    init_feeds: dict = field(default_factory=dict)   # placeholder name -> value
    parts: dict = field(default_factory=dict)        # name -> Part
    failed: dict = field(default_factory=dict)       # part that could not be traced -> why


def capture(fn, args: tuple, parts: dict | None = None, opened: dict | None = None) -> Captured:
    """`opened`: id(leaf) -> a shape whose None dimensions stay open (step_args.py)."""
    parts, opened = dict(parts or {}), opened or {}
    with recorders.slots_recorded() as owners, recorders.tape_targets() as targets:
        pieces = [_piece(_trace(fn, args, 0, "the step", opened), targets)]
    first, traced, failed, joined = len(tensor_leaves(args)), [], {}, []
    for name, (part, part_args, *rows) in parts.items():
        try:
            pieces.append(_piece(_trace(part, part_args, first, f"its {name} function",
                                        opened)))
        except Exception as e:         # a part is optional: its calls go elsewhere
            failed[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            continue
        traced.append(name)
        first += len(tensor_leaves(part_args))
        joined.extend([name] if rows else [])
    captured = _rebuild(pieces, owners, traced)
    for name in targets:            # what the step's tapes differentiated (graph/forms.py)
        captured.graph.add_to_collection(forms.TAPE_TARGETS, name)
    for name in joined:
        for out in tf.nest.flatten(captured.parts[name].outputs):
            captured.graph.add_to_collection(forms.JOINED_ROWS, out)
    recorders.note_input_gradients(captured.graph, targets.of_inputs)
    captured.failed, captured.jacobians = failed, targets.jacobians
    names = {op.name for op in captured.graph.get_operations()}   # a tape's loss in a loop:
    captured.lost = [n for n in targets if n.rsplit(":", 1)[0] not in names or  # map_fn's,
                     re.match(r"(.*/)?loop_body/", n)]     # or vectorized_map's (pfor's scope)
    return captured


def _trace(fn, args: tuple, first: int, what: str, opened: dict):
    """`fn`'s concrete function on `args`' specs (their leaves numbered from
    `first`): a trace after the first that makes variables is a GraphError.
    A tf.function's trace is the graph it runs on every call, its Python
    state frozen (tf_keras's Nadam counts its traces). A Python function,
    which runs anew on every call, is traced again: a second trace that
    differs from the first is a GraphError."""
    python = getattr(fn, "python_function", fn)
    flat = tf.nest.flatten(args)
    present = [i for i, a in enumerate(flat) if not python_value(a)]
    specs = [spec(flat[i], first + k, opened.get(id(flat[i]))) for k, i in enumerate(present)]
    structure = args

    def step(*leaves):     # an output besides fn's, which holds every stateful op
        full = list(flat)
        for i, leaf in zip(present, leaves):    # a ragged batch, fed as its sparse rows
            ragged = isinstance(flat[i], tf.RaggedTensor)
            full[i] = tf.RaggedTensor.from_sparse(
                leaf, row_splits_dtype=flat[i].row_splits.dtype) if ragged else leaf
        return python(*tf.nest.pack_sequence_as(structure, full)), tf.constant(0)

    made = []

    def creator(next_creator, **kwargs):
        made.append(kwargs.get("name") or "a variable")
        return next_creator(**kwargs)
    try:      # (a first trace that makes variables is retraced by TensorFlow, which
        # refuses a second one that makes them too: "singleton tf.Variables")
        dry = tf.function(step, autograph=True, jit_compile=False).get_concrete_function(*specs)
        if hasattr(fn, "get_concrete_function"):
            return dry      # a tf.function runs the trace it made, Python state frozen
        with tf.variable_creator_scope(creator):  # slots and layers exist by now
            concrete = tf.function(step, autograph=True,
                                   jit_compile=False).get_concrete_function(*specs)
    except (TypeError, ValueError) as e:
        if "singleton tf.Variables" not in str(e):
            raise _unknown_rows(step, specs, [flat[i] for i in present], what, e) from e
        made.append("a tf.Variable made in the step's body")
    if made:
        raise GraphError(f"{what} makes variables on every call ({made[:3]}): each "
                         "call would start from a new one. Make them once, before the "
                         "step (a Keras layer or optimizer makes its own on its first "
                         "call, which is fine)")
    changed = _differences(dry, concrete)
    if changed:
        raise GraphError(
            f"{what}'s Python code built another graph when traced a second time "
            f"({changed}): it depends on Python state that changes from call to call "
            "(a counter, a list it appends to, a random number from Python). The step "
            "is traced once and that graph runs on every call: keep such state in a "
            "tf.Variable, or out of the step; if the program runs the step as a "
            "tf.function, which keeps its first trace, pass that tf.function")
    return concrete


def _differences(a, b) -> str:
    """What two traces of the step hold differently (op types, and constants'
    values), or "" when they agree."""
    def ops(concrete):
        out = Counter()
        for n in concrete.graph.as_graph_def().node:
            # the proto, not the array: a string array's bytes are its pointers
            value = n.attr["value"].tensor.SerializeToString()[:96] if n.op == "Const" else b""
            out[(n.op, value)] += 1
        return out
    first, second = ops(a), ops(b)
    diff = sorted({op for op, _ in (first - second) + (second - first)})
    return f"{', '.join(diff[:4])} differ" if diff else ""


def _unknown_rows(step, specs, values, what: str, error: Exception) -> Exception:
    """A GraphError where `step` traces with the batch's first dimension
    known but failed (`error`) with it unknown; else `error`."""
    known = [tf.TensorSpec(np.shape(v), s.dtype) if isinstance(s, tf.TensorSpec) and
             s.shape.rank else s for s, v in zip(specs, values)]
    try:
        tf.function(step, autograph=True, jit_compile=False).get_concrete_function(*known)
    except Exception:       # noqa: BLE001 (it fails alike: the error is the program's)
        return error
    return GraphError(
        f"{what} does not trace with its batch's first dimension unknown ({error}); each "
        "replica takes a part of the global batch, so it is traced with shapes [None, ...] "
        "(as Keras's fit traces its steps): read the batch's size as tf.shape(x)[0], not "
        "x.shape[0] or len(x)")


@dataclass
class _Piece:
    """One traced function, inlined, as `_rebuild` imports it."""
    concrete: object
    graph_def: object
    replaced: dict                    # read dropped by row_reads -> what replaces it
    captured: dict                    # internal placeholder name -> tf.Variable
    constants: dict                   # internal placeholder name -> value (a captured tensor)
    inputs: list                      # the function's argument placeholders
    tables: dict = field(default_factory=dict)   # internal name -> (id of its handle, Table)
    shapes: dict = field(default_factory=dict)   # a body's node -> (type, traced shapes)


def _piece(concrete, targets=()) -> _Piece:
    """The traced function's graph without what its outputs and control
    outputs do not need, but for the losses its tapes differentiated
    (`targets`: a loss only a metric's other sum reads, as tf_keras adds a
    regularizer, is read by the loss's form, graph/forms.py)."""
    fg = concrete.graph
    by_handle = {id(v.handle): v for v in fg.variables}
    by_handle.update(recorders.unread_variables(
        {id(external) for external, internal in fg.captures
         if internal.dtype == tf.resource} - set(by_handle)))
    graph_def = inlining.inlined(concrete, list(targets) + [
        name for names, *_ in getattr(targets, "of_inputs", ()) for name in names])
    shapes = inlining.body_shapes(graph_def)
    before = _as_written(graph_def, shapes)
    variables = {internal.op.name: by_handle[id(external)]
                 for external, internal in fg.captures if id(external) in by_handle}
    row_updates(graph_def, variables, [t.name for t in concrete.outputs])
    row_divisions(graph_def, variables)
    graph_def, replaced = row_reads(graph_def)
    after = _as_written(graph_def, shapes)  # a body's node the row rewrites changed: not its shape
    shapes = {name: s for name, s in shapes.items() if before[name] == after.get(name)}
    captured, constants, tables = {}, {}, {}
    for external, internal in fg.captures:
        if internal.dtype != tf.resource:
            constants[internal.op.name] = external.numpy()
            continue
        var = by_handle.get(id(external))
        if var is None:            # a lookup table the step reads, else a GraphError
            tables[internal.op.name] = (id(external),
                                        lookup.contents(external, internal.op.name, graph_def))
            continue
        captured[internal.op.name] = var
    inside = {internal.op.name for _, internal in fg.captures}
    inputs = [t.op.name for t in fg.inputs if t.op.name not in inside]
    needed = _ancestors(graph_def, {t.op.name for t in tf.nest.flatten(concrete.outputs)} |
                        {replaced.get(op.name, op.name) for op in fg.control_outputs} - {None}
                        | {name.rsplit(":", 1)[0] for name in targets} | {
                            name.rsplit(":", 1)[0] for names, *_ in
                            getattr(targets, "of_inputs", ()) for name in names})
    keep = [n for n in graph_def.node if n.name in needed and n.name not in captured and
            n.name not in constants and n.name not in inputs and n.name not in tables]
    del graph_def.node[:]
    graph_def.node.extend(keep)
    for node in graph_def.node:
        if "_class" in node.attr:
            del node.attr["_class"]
    return _Piece(concrete, graph_def, replaced, captured, constants, inputs, tables, shapes)


def _as_written(graph_def, names) -> dict:
    return {n.name: n.SerializeToString(deterministic=True) for n in graph_def.node
            if n.name in names}


def _rebuild(pieces: list, owners: dict, parts: list) -> Captured:
    """The step (`pieces[0]`) and its parts (the rest, named `parts`) in
    one tf.Graph sharing their variables; a part's ops under its scope."""
    variables = {}                    # id -> tf.Variable, the step's first
    for piece in pieces:
        for var in piece.captured.values():
            variables.setdefault(id(var), var)
    owners = {**recorders.owners_by_name(list(variables.values())), **owners}
    values = {i: v.numpy() for i, v in variables.items()}
    graph = tf.Graph()
    made, names, feeds, runs, placeholders = {}, set(), {}, [], []
    tables = {}                       # id of the program's table handle -> (handle, fill)
    with graph.as_default():
        for piece in pieces:
            placeholders.append(_placeholders(piece, sum(map(len, placeholders))))
        for var in sorted(variables.values(), key=lambda v: v.ref() in owners):  # owners first
            vname = _unique(_variable_name(var), names)
            owner = owners.get(var.ref())
            scope = graph.colocate_with(made[id(owner)].op) \
                if owner is not None and id(owner) in made else contextlib.nullcontext()
            with scope:
                initial = tf.compat.v1.placeholder(var.dtype.base_dtype, var.shape,
                                                   name=f"{vname}/initial_value")
                new = tf.compat.v1.Variable(initial, name=vname, use_resource=True,
                                            trainable=var.trainable)
            made[id(var)] = new
            feeds[initial.name] = values[id(var)]
        for k, piece in enumerate(pieces):
            scope = "" if k == 0 else PART.format(parts[k - 1])
            # a capture or an argument no kept op reads is not mapped (import refuses it)
            read = _read(piece.graph_def)
            input_map = {f"{name}:0": made[id(var)].handle
                         for name, var in piece.captured.items() if name in read}
            input_map.update({f"{name}:0": t for name, t in
                              zip(piece.inputs, (t for _, ts in placeholders[k] for t in ts))
                              if name in read})
            input_map.update({f"{name}:0": tf.constant(value, name=f"{scope or 'parallax'}"
                                                                  f"_captured/{j}")
                              for j, (name, value) in enumerate(sorted(piece.constants.items()))
                              if name in read})
            for name, (key, table) in sorted(piece.tables.items()):
                if key not in tables:
                    tables[key] = lookup.make(table, f"parallax_table_{len(tables)}")
                input_map[f"{name}:0"] = tables[key][0]
            fg = piece.concrete.graph
            out_names = [t.name for t in tf.nest.flatten(piece.concrete.outputs)]
            controls = sorted({piece.replaced.get(op.name, op.name)
                               for op in fg.control_outputs} - {None})
            returned = tf.graph_util.import_graph_def(
                piece.graph_def, input_map=input_map, return_elements=out_names + controls,
                name=scope)
            outs, ops = returned[:len(out_names)], returned[len(out_names):]
            _restore_shapes(graph, fg, piece, scope)
            with tf.control_dependencies([t.op for t in outs] + ops):
                run = tf.no_op(name=f"{scope}_run" if scope else "parallax_step")
            tensors = iter(t.name for t in outs)      # fn's, in order (None: no output)
            runs.append((tf.nest.map_structure(lambda t: None if t is None else next(tensors),
                                               piece.concrete.structured_outputs)[0],
                         run.name))
        inlining.loop_shapes(graph)     # (every piece's loops, once)
        if tables:
            init = tf.group(tf.compat.v1.variables_initializer(list(made.values())),
                            *(fill for _, fill in tables.values()), name="parallax_init")
        else:
            init = tf.compat.v1.variables_initializer(list(made.values()), name="parallax_init")
    return Captured(graph, [name for name, _ in placeholders[0]], runs[0][0], runs[0][1],
                    {made[i].op.name: v for i, v in variables.items()},
                    {made[i].op.name: made[i]._graph_element.name for i in variables},
                    init.name, feeds,
                    parts={name: Part([n for n, _ in placeholders[k + 1]], *runs[k + 1])
                           for k, name in enumerate(parts)})


def _restore_shapes(graph, traced, piece: _Piece, scope: str) -> None:
    """The traced shapes of imported outputs whose rank shape inference
    does not find again: a GraphDef keeps only what it finds, not what
    Python code set (`set_shape`: a table lookup's, a numpy_function's),
    and a fetch of unknown rank would be taken for a batch
    (runtime/fetches.py); nor, in a lowered loop, any shape after its
    Merge ops (inlining.body_shapes, loop_shapes: without them a batch's
    statistic in a TF2 step's loop had no rank, and went unnamed). An
    output of known rank keeps its own: the row rewrites (row_updates.py)
    keep names but not the whole table's shape."""
    prefix = f"{scope}/" if scope else ""
    for node in piece.graph_def.node:
        try:
            new = graph.get_operation_by_name(prefix + node.name)
        except KeyError:
            continue
        try:
            old = traced.get_operation_by_name(node.name)
            kind, shapes = old.type, [t.shape for t in old.outputs]
        except KeyError:        # (an op of a function's body)
            kind, shapes = piece.shapes.get(node.name, (None, ()))
        if kind != new.type:
            continue
        for a, b in zip(new.outputs, shapes):
            if a.shape.rank is None and b.rank is not None:
                try:
                    a.set_shape(b)
                except ValueError:          # not the traced op's shape after all
                    pass


def _placeholders(piece: _Piece, first: int) -> list:
    """A placeholder per leaf of the piece's arguments, numbered from
    `first`: (its name, the tensors its function's inputs take in order);
    a SparseTensor's is a `sparse_placeholder` (NAME/indices, NAME/values,
    NAME/shape: fed as a batch of rows, runtime/fetches.py)."""
    out = []
    for i, given in enumerate(piece.concrete.structured_input_signature[0]):
        name = INPUT.format(first + i)
        if isinstance(given, tf.SparseTensorSpec):
            sp = tf.compat.v1.sparse_placeholder(given.dtype, given.shape, name=name)
            out.append((name, [sp.indices, sp.values, sp.dense_shape]))
        else:
            out.append((name, [tf.compat.v1.placeholder(given.dtype, given.shape, name=name)]))
    return out


def _read(graph_def) -> set:
    """The names of the nodes `graph_def`'s nodes take as inputs."""
    return {i.lstrip("^").split(":")[0] for node in graph_def.node for i in node.input}


def _ancestors(graph_def, roots: set) -> set:
    """`roots` and every node they wait on (data or control): what a run of
    them executes. The rest (a result the step drops, e.g. an Identity of a
    clipped gradient) would only hold back passes that move ops by their
    consumers."""
    inputs = {n.name: [i.lstrip("^").split(":")[0] for i in n.input] for n in graph_def.node}
    out, todo = set(), list(roots)
    while todo:
        name = todo.pop()
        if name not in out and name in inputs:
            out.add(name)
            todo.extend(inputs[name])
    return out


def _variable_name(var) -> str:
    path = var.name
    return re.sub(r"[^A-Za-z0-9_./-]", "_", path.split(":")[0]) or "variable"


def _unique(name: str, names: set) -> str:
    out, k = name, 1
    while out in names:
        out, k = f"{name}_{k}", k + 1
    names.add(out)
    return out

