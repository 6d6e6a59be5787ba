"""Keras 3's division of a sparse gradient by a dense tensor, made to read
the gradient's rows (an Adagrad or Adadelta step on an embedding).

Keras 3 divides an IndexedSlices by a dense tensor S (Adagrad: the rows by
the square root of the whole accumulator) in a tf.cond
(keras/src/backend/tensorflow/sparse.py, `elementwise_division`): if S
has a zero or a NaN anywhere, the result takes the union of the rows and
those places; else it is the rows divided by S gathered at their ids. The
check and S are whole-table ops every step (a read of the table, an add,
a square root, two comparisons and two reductions: most of such a step on
a large table, one device's too).

Requires: a GraphDef of one traced function (calls inlined, lowered to
Switch/Merge, as `inlining.inlined` makes it) and {placeholder name:
tf.Variable} of the variables it captures.
Guarantees (`row_divisions`): for each such cond, recognised by its false
branch (a GatherV2 of S at ids, each through a Switch on the cond's
predicate) and its predicate (Any of Equal(S, 0) or IsNan(S)), where S is
elementwise ops (graph/row_updates.MOVABLE) of whole reads of variables
of S's shape and scalars:
- the predicate becomes the same check of S's rows at the ids (the reads
  made ResourceGathers at the ids, with the reads' waits);
- the false branch takes those rows where it gathered S;
- the true branch gets S and its check computed from reads behind a
  Switch on the new predicate: they run only when that branch does;
- the old S and check are dropped (their whole read too, by the capture).
The result equals the cond's wherever S has no zero or NaN outside the
rows: there the old cond took the union and wrote NaN or infinity into
rows the gradient does not touch (Adagrad with `epsilon=0`).
"""
from __future__ import annotations

import numpy as np
import tensorflow as tf

from .row_updates import MOVABLE, GraphDefEdit, tensor_name


def row_divisions(graph_def, variables: dict) -> list[str]:
    """Rewrites `graph_def` in place (the module docstring says what);
    returns the names of the gathers whose cond now checks rows."""
    if not any(n.op == "GatherV2" for n in graph_def.node):
        return []
    edit = _Divisions(graph_def, variables)
    return [n.name for n in list(graph_def.node)
            if n.op == "GatherV2" and edit.try_division(n.name)]


_tensor = tensor_name


class _Divisions(GraphDefEdit):
    def try_division(self, name: str) -> bool:
        """A GatherV2 of a divisor S at the rows' ids in the false branch of
        such a cond: the branch is taken by S's rows alone (S at the ids);
        the whole S and its check are computed only in the true branch."""
        gather = self.nodes[name]
        if gather.attr["batch_dims"].i or len(gather.input) < 3:
            return False
        params, ids = (self._through_identities(_tensor(i)) for i in gather.input[:2])
        switches = [self.nodes[t.split(":")[0]] for t in (params, ids)]
        if any(sw.op != "Switch" or not t.endswith(":0")
               for sw, t in zip(switches, (params, ids))) or \
                switches[0].input[1] != switches[1].input[1]:
            return False
        whole, ids, pred = _tensor(switches[0].input[0]), _tensor(switches[1].input[0]), \
            _tensor(switches[0].input[1])
        shape = self.shape(whole)
        check = self._check(pred, whole)
        chain = self._chain(whole, shape)
        if not shape.is_fully_defined() or check is None or chain is None or \
                not self._only_path(_tensor(gather.input[0]), params):
            return False
        rows = self._copy(chain, whole, "parallax_rows", lambda read: tf.compat.v1.NodeDef(
            name=f"{read.name}/parallax_rows", op="ResourceGather",
            input=[read.input[0], ids, *[i for i in read.input if i.startswith("^")]]), ids)
        rows_pred = self._copy(check, pred, "parallax_rows", None, None, {whole: rows})
        done = {}
        gated_reads = {}

        def gated_read(read):
            switch = tf.compat.v1.NodeDef(name=f"{read.name}/parallax_when", op="Switch",
                                          input=[read.input[0], rows_pred])
            switch.attr["T"].type = tf.resource.as_datatype_enum
            self.add(switch)
            out = tf.compat.v1.NodeDef(name=f"{read.name}/parallax_whole", op="ReadVariableOp",
                                       input=[f"{switch.name}:1", *read.input[1:]])
            out.attr["dtype"].type = read.attr["dtype"].type
            gated_reads[read.name] = out.name
            return out
        done[whole] = self._copy(chain, whole, "parallax_whole", gated_read, None)
        gated, gated_check = done[whole], {t: self._copy(check, t, "parallax_whole", None,
                                                         None, done) for t in check}
        for node in list(self.graph_def.node):        # the cond takes the rows' check, and
            if node.op != "Switch" or _tensor(node.input[1]) != pred:   # its true branch
                continue                                                # the gated whole
            node.input[1] = rows_pred
            data = _tensor(node.input[0])
            if data == pred:
                node.input[0] = rows_pred
            elif data == whole:
                node.input[0] = gated
            elif data in gated_check:
                node.input[0] = gated_check[data]
        taken = tf.compat.v1.NodeDef(name=f"{name}/parallax_rows_switch", op="Switch",
                                     input=[rows, rows_pred])
        taken.attr["T"].type = self.dtype(whole)
        self.add(taken)
        controls = [i for i in gather.input if i.startswith("^")]
        gather.Clear()
        gather.name, gather.op = name, "Identity"
        gather.input.extend([f"{taken.name}:0", *controls])
        gather.attr["T"].type = self.dtype(whole)
        self.prune({t.split(":")[0] for t in [*chain, *check]} - {
            n.name for n in chain.values() if n.op == "ReadVariableOp"})
        return True

    def _through_identities(self, tensor: str) -> str:
        node = self.nodes.get(tensor.split(":")[0])
        while node is not None and node.op == "Identity":
            tensor = _tensor(node.input[0])
            node = self.nodes.get(tensor.split(":")[0])
        return tensor

    def _only_path(self, tensor: str, source: str) -> bool:
        """Whether every tensor from `source` down Identities to `tensor` has
        one use, the next one down."""
        while tensor != source:
            node = self.nodes[tensor.split(":")[0]]
            above = _tensor(node.input[0])
            if node.op != "Identity" or len(self.users[above]) != 1:
                return False
            tensor = above
        return True

    def _check(self, pred: str, whole: str):
        """The nodes between `whole` and the scalar `pred` if `pred` says
        whether `whole` has a zero or a NaN (Equal to 0, IsNan, LogicalOr,
        Any), else None; {tensor: node} of them."""
        out, todo = {}, [pred]
        while todo:
            t = todo.pop()
            if t == whole or t in out:
                continue
            node = self.nodes[t.split(":")[0]]
            if node.op == "Const":
                continue
            if node.op not in ("Any", "LogicalOr", "Equal", "IsNan") or t.endswith((":1", ":2")):
                return None
            if node.op == "Equal" and not any(
                    self.nodes[i.split(":")[0]].op == "Const" and not np.any(tf.make_ndarray(
                        self.nodes[i.split(":")[0]].attr["value"].tensor)) for i in node.input):
                return None
            out[t] = node
            todo.extend(_tensor(i) for i in node.input if not i.startswith("^"))
        return out if whole in {_tensor(i) for n in out.values() for i in n.input} else None

    def _chain(self, whole: str, shape):
        """The elementwise ops from whole reads of variables of `shape` (and
        scalars) to `whole`, {tensor: node}, or None."""
        out, todo = {}, [whole]
        while todo:
            t = todo.pop()
            node = self.nodes[t.split(":")[0]]
            if t in out or node.op == "Const" and self.shape(t).rank == 0:
                continue
            if self.shape(t) != shape and self.shape(t).rank == 0:
                continue
            if node.op == "ReadVariableOp" and self.variable_shape(node.input[0]) == shape:
                out[t] = node
                continue
            if node.op not in MOVABLE or self.shape(t) != shape:
                return None
            out[t] = node
            todo.extend(_tensor(i) for i in node.input if not i.startswith("^"))
        return out

    def _copy(self, nodes: dict, top: str, suffix: str, read, ids, done=None) -> str:
        """A copy of the ops `nodes` computing `top`, each named with
        `suffix`, reads made by `read` (a NodeDef maker), tensors of `done`
        replaced (`done` gets the copies made); returns the copy of `top`."""
        done = {} if done is None else done

        def copy(t):
            if t in done:
                return done[t]
            if t not in nodes:
                return t
            node = nodes[t]
            if node.op == "ReadVariableOp":
                new = read(node)
                if new.op == "ResourceGather":
                    new.attr["dtype"].type = node.attr["dtype"].type
                    new.attr["Tindices"].type = self.dtype(ids)
                    new.attr["batch_dims"].i = 0
                    new.attr["validate_indices"].b = True
            else:
                new = tf.compat.v1.NodeDef()
                new.CopyFrom(node)
                new.name = f"{node.name}/{suffix}"
                del new.input[:]
                new.input.extend(i if i.startswith("^") else copy(_tensor(i))
                                 for i in node.input)
            self.add(new)
            done[t] = f"{new.name}:{t.split(':')[1]}"
            return done[t]
        return copy(top)

