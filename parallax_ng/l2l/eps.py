"""The eager parameter server (EPS) of layer-to-layer execution: what the
host does with the gradients the layers send (parallax_ng/l2l/builder.py).

Requires: a graph under construction, its host device as the current
device scope.
Guarantees:
- `gradient_sum(var, grad, parts, replicas, ...)`: the tensor(s) the user's
  update ops read as `grad` of variable `var`, from the layers' contributions
  `parts` ((replica, tensor or IndexedSlices)): a dense gradient is summed
  per replica as each contribution arrives (a chain of adds in their order),
  then across replicas; a sparse one stays IndexedSlices (every
  contribution's rows, so an optimizer that touches only the rows given
  still does; summed by id where one device's gradient holds each id once,
  `unique`: TrainingGraph.rows_unique); cmp's float16 gradients of the
  scaled loss come back to the variable's dtype, unscaled;
- `Workers`: in a job, one EPS per worker: `all_reduce` sums a tensor over
  the workers' hosts (a sparse gradient as its dense sum and the rows any
  worker touched, summed rows), `sync` sets every worker's variables to
  worker 0's, both through the hosts' collectives (comm/lowering.py
  host_lowering, whose instance keys are taken in call order, the same on
  every worker building the same graph);
- `reduced(...)`: every gradient the user's update ops read, as its sum
  (`gradient_sum`), checked finite under cmp before any update uses one;
  `check_updates` says when the update ops would need the forward pass;
- `shard_inputs(nodes, library, ...)`: the user's pn.shard() constants (in
  the graph or in a dataset function) set to (workers, worker), by
  graph/data.py's set_shard (as the shard_inputs pass sets them).
"""
from __future__ import annotations

import tensorflow as tf

from ..comm.collectives import HostCollectives
from ..errors import GraphError
from ..graph.data import seeded_shuffles, set_shard


class Workers:
    def __init__(self, comm: HostCollectives):
        """`comm`: the collectives among the workers' hosts (comm/lowering.py)."""
        self.comm = comm
        self.workers, self.worker = comm.workers, comm.worker

    def all_reduce(self, t: tf.Tensor) -> tf.Tensor:
        return t if self.workers == 1 else self.comm.all_reduce(t)

    def all_rows(self, values, indices, rows: int):
        """Every worker's rows of a sparse gradient: the dense sum of all and
        the rows any worker touched, as (values, indices) of summed rows."""
        if self.workers == 1:
            return values, indices
        dense = self.all_reduce(tf.math.unsorted_segment_sum(values, indices, rows))
        touched = self.all_reduce(tf.math.unsorted_segment_sum(
            tf.ones_like(indices, tf.float32), indices, rows))
        where = tf.cast(tf.reshape(tf.where(touched > 0), [-1]), indices.dtype)
        return tf.gather(dense, where), where

    def sync(self, graph: tf.Graph, variables: dict, scope: str) -> tf.Operation | None:
        """Worker 0's value of every variable (frontend.Variable by name) on
        every worker."""
        if self.workers == 1:
            return None
        ops = []
        with tf.compat.v1.name_scope(scope + "/"):
            for name, var in sorted(variables.items()):
                v = graph.get_operation_by_name(name)
                resource = v.type == "VarHandleOp"
                if self.worker == 0:
                    value = tf.raw_ops.ReadVariableOp(resource=v.outputs[0], dtype=var.dtype) \
                        if resource else tf.identity(v.outputs[0])
                    ops.append(self.comm.broadcast(value))
                    continue
                got = self.comm.receive(var.dtype, var.shape)
                ops.append(tf.raw_ops.AssignVariableOp(resource=v.outputs[0], value=got)
                           if resource else tf.compat.v1.assign(v.outputs[0], got))
        return tf.group(*ops, name=f"{scope}/all")


def gradient_sum(var: str, grad, parts: list, replicas: int, value_dtype: tf.DType,
                 index_dtype: tf.DType | None, workers: Workers, rows: int | None,
                 scale: float = 1.0, unique: bool = False) -> dict[str, tf.Tensor]:
    """User gradient tensor name (values, and indices when sparse) -> the
    EPS's sum of `parts`; `scale`: the loss scale to divide out (cmp)."""
    if not parts:
        raise GraphError(f"variable {var!r} has a gradient in the user's graph but no layer "
                         "reads it in the forward pass")
    parts = [(r, _unscaled(g, value_dtype, scale)) for r, g in parts]
    if grad.sparse:
        if not all(isinstance(g, tf.IndexedSlices) for _, g in parts):
            raise GraphError(f"variable {var!r}: the user's gradient is sparse "
                             "(IndexedSlices) but a layer's is dense")
        values = tf.concat([tf.identity(g.values) for _, g in parts], 0)
        indices = tf.concat([tf.cast(g.indices, index_dtype) for _, g in parts], 0)
        if unique and workers.workers == 1:    # (all_rows sums the workers' by id)
            indices, at = tf.unique(indices)
            values = tf.math.unsorted_segment_sum(values, at, tf.size(indices))
        values, indices = workers.all_rows(values, indices, rows)
        return {tensor_name(grad.values): values, tensor_name(grad.indices): indices}
    sums = []
    for r in range(replicas):
        acc = None
        for rr, g in parts:
            if rr == r:
                g = tf.convert_to_tensor(g)
                acc = tf.identity(g) if acc is None else acc + g
        if acc is not None:
            sums.append(acc)
    total = sums[0] if len(sums) == 1 else tf.add_n(sums)
    return {tensor_name(grad.values): workers.all_reduce(total)}


def reduced(tg, contributions: dict, replicas: int, job: Workers, scale: float,
            average: tuple[bool, bool], half: bool, scope: str) -> dict[str, tf.Tensor]:
    """User gradient tensor name -> the EPS's sum of the layers' gradients
    (`contributions`: variable -> [(replica, gradient)]), on the current
    device; under cmp (`half`) every sum checked finite before any is used."""
    out = {}
    total = replicas * job.workers
    with tf.name_scope(scope):
        for var, grad in tg.gradients.items():
            # the layers' gradients are of the loss over the replicas' mean
            # (module docstring); summed over replicas, they are multiplied back
            mean = average[1 if grad.sparse else 0]
            sums = gradient_sum(
                var, grad, contributions.get(var, []), replicas,
                tg.tensor(grad.values).dtype,
                tg.tensor(grad.indices).dtype if grad.sparse else None,
                job, tg.variables[var].shape[0] if grad.sparse else None,
                scale if mean else scale / total, var in tg.rows_unique)
            if half:
                checked = tensor_name(grad.values)
                sums[checked] = tf.debugging.check_numerics(
                    sums[checked],
                    f"layer-by-layer execution with precision cmp: the gradient of {var!r} "
                    f"overflowed float16 at loss scale {scale:g} (inf or NaN); no "
                    "variable was updated in this step; lower l2l.loss_scale")
            out.update(sums)
        if half:       # all or nothing: every update waits for every check
            checks = [t.op for name, t in out.items() if t.op.type == "CheckNumerics"]
            with tf.control_dependencies(checks):
                out = {name: tf.identity(t) for name, t in out.items()}
    return out


def check_updates(graph, tg, segments) -> None:
    """The update ops (in `graph`, the L2L graph) must not need the user's
    forward (it is never run whole: batch statistics, a loss-dependent
    schedule would need it)."""
    forward = {n for s in segments for n in s.ops}
    roots = [graph.get_operation_by_name(w) for ws in tg.writers.values() for w in ws]
    seen, todo = set(), [(op, None) for op in roots]
    while todo:
        op, user = todo.pop(0)           # breadth first: the nearest forward op
        if op.name in seen:
            continue
        seen.add(op.name)
        if op.name in forward:
            raise GraphError(
                f"the update ops read the forward pass: {user.name!r} ({user.type}) reads "
                f"{op.name!r} ({op.type}); layer-by-layer execution never runs the whole "
                "forward at once, so updates may read gradients, variables and feeds "
                "only (batch-norm statistics and loss-dependent updates are not supported)")
        todo.extend((t.op, op) for t in op.inputs)
        todo.extend((c, op) for c in op.control_inputs)


def shard_inputs(nodes: dict, library, shard_consts, workers: int, worker: int):
    """(nodes, library) with pn.shard()'s constants set to this worker's
    shard, a shuffle without seeds seeded by its name; `nodes` (name ->
    NodeDef) and `library` are not changed."""
    nodes = dict(nodes)
    for name in (n for pair in shard_consts for n in pair):
        node = type(nodes[name])()
        node.CopyFrom(nodes[name])
        set_shard(node, workers, worker)
        nodes[name] = node
    nodes.update(seeded_shuffles(nodes))        # every worker shuffles alike
    out = type(library)()
    out.CopyFrom(library)
    for f in out.function:
        seeds = seeded_shuffles({body.name: body for body in f.node_def})
        for body in f.node_def:
            set_shard(body, workers, worker)
            if body.name in seeds:
                body.CopyFrom(seeds[body.name])
    return nodes, out


def _unscaled(g, dtype: tf.DType, scale: float):
    """A (float16) gradient of the loss times `scale`, as the EPS keeps it."""
    if g.dtype == dtype and scale == 1.0:
        return g
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(tf.cast(g.values, dtype) / scale, g.indices, g.dense_shape)
    return tf.cast(g, dtype) / scale


def tensor_name(ref) -> str:
    """A gradient reference of the TrainingGraph (node, index) as a tensor name."""
    return f"{ref.node}:{ref.index}"
