"""Whole-table reads and updates of a traced step that need only some
rows, rewritten to touch those rows (Keras 3's Embedding and its
optimizers after `global_clipnorm`).

`row_reads`: Keras 3's Embedding gathers rows from a whole read of the
table and reads the whole table again for its gradient's shape; once a
variable has had a sparse access TensorFlow copies it on every whole
read, and a whole read a later write outlives is copied too. Its
docstring says what it rewrites.

Keras 3 clips an embedding's gradient (an IndexedSlices) by the global norm
by scaling a dense tensor: the rows become a whole-table gradient (an
UnsortedSegmentSum of the values at their ids), and an update such as
Adagrad's or SGD's then runs on every row of the table and its slots
(square, multiply, add, square root, divide, assign), though the rows
without gradient add or subtract zero. On a large table those ops are the
step: one device pays them, and so would every replica or server.

Requires: a GraphDef of one traced function (calls inlined, as
`inlining.inlined` makes it) and {placeholder name: tf.Variable} of the
variables it captures.
Guarantees (`row_updates`): every UnsortedSegmentSum D of (values, ids)
into a static shape whose uses, followed through the tensors they make,
are all
- zero wherever D is zero: Square, Neg, Identity, IdentityN, Cast, a Mul
  by a scalar, by a tensor of D's shape or by another such tensor, a
  RealDiv of one by a scalar or a tensor of D's shape;
- ending in AssignAddVariableOp / AssignSubVariableOp of a variable of
  D's shape, or in a Sum over every axis (none returned by the step: a
  count per class it returns keeps its classes),
is computed at the distinct ids only: D becomes the rows' sums at
Unique(ids), every op on the way the same op on those rows, a tensor of
D's shape that one of them takes is read at those rows (a ReadVariableOp
becomes a ResourceGather, an elementwise op of such tensors moves to the
rows, anything else is gathered), and the writes become
ResourceScatterAdd / ResourceScatterSub at the ids. Rewritten nodes keep
their names, so the control edges that order a step's reads and writes
hold. Each row gets the value the whole-table update gives it, in the same
order of operations; the rows without gradient keep their values where the
whole-table update adds an exact zero to them (it would make them NaN only
by dividing zero by a zero or multiplying it by an infinity there). A Sum
over every axis adds the same numbers without the zeros; where D sums
squares (Keras's squared norm of an IndexedSlices, its only use such
Sums), they become 2 * L2Loss of the values, the form a sparse
aggregation supplies from each replica's rows (planning/coalescing.py).
`GraphDefEdit` is the in-place editing both this module and
graph/row_divisions.py use.
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np
import tensorflow as tf

ZERO_KEEPING = frozenset({"Square", "Neg", "Identity", "Cast"})
WRITES = {"AssignAddVariableOp": "ResourceScatterAdd",
          "AssignSubVariableOp": "ResourceScatterSub"}
# elementwise ops that a whole-table operand is moved to the rows through
MOVABLE = frozenset({"AddV2", "Add", "Sub", "Mul", "RealDiv", "Sqrt", "Rsqrt", "Square",
                     "Maximum", "Minimum", "Neg", "Identity", "Cast"})


def row_updates(graph_def, variables: dict, outputs=()) -> list[str]:
    """Rewrites `graph_def` in place (the module docstring says what);
    returns the names of the writes that became row updates. `outputs`:
    the names of the tensors the step returns."""
    if not any(n.op == "UnsortedSegmentSum" for n in graph_def.node):
        return []
    rewrite = _Sums(graph_def, variables, outputs)
    return [w for node in list(graph_def.node) if node.op == "UnsortedSegmentSum"
            for w in rewrite.try_sum(node.name)]


def tensor_name(name: str) -> str:
    """A NodeDef input as a tensor name ("op" -> "op:0")."""
    return name if ":" in name else name + ":0"


_tensor = tensor_name


def row_reads(graph_def):
    """Gathers of rows from a whole read of a variable (Keras 3's Embedding:
    GatherV2 along axis 0 of a ReadVariableOp that nothing else reads) as
    ResourceGather of the variable, under the gather's name: the step reads
    the rows, not the table (a whole read that a later write in the step
    outlives makes TensorFlow copy the table first). Shapes of a whole read
    (and nothing else) become VariableShape, and a read that nothing reads
    (its shape folded to a constant) is dropped: a variable once read or
    written by rows copies itself on every whole read. Returns the graph
    and {dropped read: the op that replaces it, or None}."""
    nodes = {n.name: n for n in graph_def.node}
    uses = Counter(i.split(":")[0] for n in graph_def.node for i in n.input
                   if not i.startswith("^"))
    dropped = {}
    for n in graph_def.node:
        if n.op != "GatherV2" or n.attr["batch_dims"].i != 0 or len(n.input) < 3:
            continue
        read, axis = nodes.get(n.input[0].split(":")[0]), nodes.get(n.input[2].split(":")[0])
        if read is None or read.op != "ReadVariableOp" or uses[read.name] != 1 or \
                axis is None or axis.op != "Const" or \
                tf.make_ndarray(axis.attr["value"].tensor).tolist() != 0:
            continue
        gather = tf.compat.v1.NodeDef(name=n.name, op="ResourceGather", device=n.device)
        gather.input.extend([read.input[0], n.input[1]] + list(read.input[1:]) +
                            [i for i in n.input[3:] if i.startswith("^")])
        gather.attr["dtype"].CopyFrom(read.attr["dtype"])
        gather.attr["Tindices"].CopyFrom(n.attr["Tindices"])
        gather.attr["batch_dims"].i = 0
        gather.attr["validate_indices"].b = True
        n.CopyFrom(gather)
        dropped[read.name] = n.name
    shapes = defaultdict(list)
    for n in graph_def.node:
        if n.op == "Shape":
            shapes[n.input[0].split(":")[0]].append(n)
    for name, users in shapes.items():
        read = nodes.get(name)
        if read is None or read.op != "ReadVariableOp" or len(users) != uses[name]:
            continue
        for n in users:
            out_type = n.attr["out_type"].type
            n.op, n.input[0] = "VariableShape", read.input[0]
            n.input.extend(i for i in read.input[1:] if i not in n.input)
            del n.attr["T"]
            n.attr["out_type"].type = out_type
        dropped[name] = users[0].name
    for n in graph_def.node:
        if n.op == "ReadVariableOp" and not uses[n.name]:
            dropped[n.name] = None

    def waits(i):      # a wait on a read: on what replaces it, or on what the read waited on
        if not i.startswith("^") or i[1:] not in dropped:
            return [i]
        if dropped[i[1:]] is not None:
            return ["^" + dropped[i[1:]]]
        return [w for c in nodes[i[1:]].input if c.startswith("^") for w in waits(c)]
    keep = [n for n in graph_def.node if n.name not in dropped]
    for n in keep:
        inputs = [w for i in n.input for w in waits(i)]
        del n.input[:]
        n.input.extend(i for k, i in enumerate(inputs)
                       if not i.startswith("^") or i not in inputs[:k])
    del graph_def.node[:]
    graph_def.node.extend(keep)
    return graph_def, dropped



class GraphDefEdit:
    """A GraphDef being rewritten in place: its nodes by name, the uses of
    each tensor (as the edit began), static shapes and dtypes (from a copy
    imported once, on the first question, with the captured variables'
    shapes), and ways to add and drop nodes."""

    def __init__(self, graph_def, variables):
        self.graph_def, self.variables = graph_def, variables
        self.nodes = {n.name: n for n in graph_def.node}
        self.users = defaultdict(list)          # tensor -> [(node name, input position)]
        for n in graph_def.node:
            for pos, i in enumerate(n.input):
                if not i.startswith("^"):
                    self.users[_tensor(i)].append((n.name, pos))
        self._graph = None

    def shape(self, tensor: str) -> tf.TensorShape:
        if self._graph is None:
            self._graph = tf.Graph()
            with self._graph.as_default():        # handles that know their variables' shapes
                handles = {f"{name}:0": tf.raw_ops.VarHandleOp(
                    dtype=v.dtype.base_dtype, shape=v.shape, shared_name=f"parallax_shape_{k}")
                    for k, (name, v) in enumerate(self.variables.items())}
                tf.graph_util.import_graph_def(self.graph_def, input_map=handles, name="")
        return self._graph.get_tensor_by_name(tensor).shape

    def dtype(self, tensor: str):
        self.shape(tensor)
        return self._graph.get_tensor_by_name(tensor).dtype.as_datatype_enum

    def variable_shape(self, handle: str):
        var = self.variables.get(handle.split(":")[0])
        return None if var is None else var.shape

    def add(self, node) -> None:
        self.graph_def.node.append(node)
        self.nodes[node.name] = self.graph_def.node[-1]

    def prune(self, names: set) -> None:
        """Drops the nodes of `names` that nothing uses any more (a whole
        read they leave unused the capture drops, keeping the step's order)."""
        while True:
            used = {i.lstrip("^").split(":")[0] for n in self.graph_def.node for i in n.input}
            gone = {n for n in names if n in self.nodes and n not in used}
            if not gone:
                return
            keep = [n for n in self.graph_def.node if n.name not in gone]
            del self.graph_def.node[:]
            self.graph_def.node.extend(keep)
            self.nodes = {n.name: n for n in self.graph_def.node}


class _Sums(GraphDefEdit):
    def __init__(self, graph_def, variables, outputs):
        super().__init__(graph_def, variables)
        self.outputs = set(outputs)             # the step's (kept whole)
        self.unique = {}                        # ids tensor -> the Unique node's name
        self.rows = {}                          # (tensor, ids) -> its rows

    def try_sum(self, name: str) -> list[str]:
        shape = self.shape(name + ":0")
        if not shape.is_fully_defined() or shape.rank < 1:
            return []
        found = self._uses(name, shape)
        if found is None:
            return []
        if not found[2] and self._squared_norm(name):
            return []
        _, whole, writes = found
        ids = _tensor(self.nodes[name].input[1])
        unique = self._unique_of(ids, name)
        sum_node = self.nodes[name]
        sum_node.input[1], sum_node.input[2] = f"{unique}:1", f"{unique}/size"
        sum_node.attr["Tindices"].type = tf.int32.as_datatype_enum
        sum_node.attr["Tnumsegments"].type = tf.int32.as_datatype_enum
        for user, pos in sorted(whole):
            self.nodes[user].input[pos] = self._rows_of(_tensor(self.nodes[user].input[pos]),
                                                        shape, ids, user)
        for write in writes:
            node = self.nodes[write]
            node.op = WRITES[node.op]
            node.input.insert(1, f"{unique}:0")
            node.attr["Tindices"].type = self.dtype(ids)
        return writes

    def _squared_norm(self, name: str) -> bool:
        """Sums of every element of D = UnsortedSegmentSum(Square(x)) (Keras
        3's global norm of an IndexedSlices) as 2 * L2Loss(x), the squared
        norm's form a sparse aggregation computes from each replica's rows
        (planning/coalescing.py); D and the Square are dropped."""
        node = self.nodes[name]
        square = self.nodes[node.input[0].split(":")[0]]
        sums = [u for u, _ in self.users[name + ":0"]]
        if square.op != "Square" or [u for u, _ in self.users[square.name + ":0"]] != [name] \
                or any(self.nodes[u].attr["keep_dims"].b for u in sums) \
                or any(i in ("^" + name, "^" + square.name)
                       for m in self.graph_def.node for i in m.input):
            return False
        for u in sums:
            total = self.nodes[u]
            dtype = total.attr["T"].type
            half = tf.compat.v1.NodeDef(name=f"{u}/parallax_l2loss", op="L2Loss",
                                        input=[square.input[0]])
            half.attr["T"].type = dtype
            two = tf.compat.v1.NodeDef(name=f"{u}/parallax_two", op="Const")
            two.attr["dtype"].type = dtype
            two.attr["value"].tensor.CopyFrom(
                tf.make_tensor_proto(2, tf.dtypes.as_dtype(dtype)))
            controls = [i for i in total.input if i.startswith("^")]
            total.Clear()
            total.name, total.op = u, "Mul"
            total.input.extend([half.name, two.name, *controls])
            total.attr["T"].type = dtype
            self.add(half)
            self.add(two)
        self.prune({name, square.name})
        return True

    def _uses(self, name: str, shape):
        """(tensors zero where D is, whole-table operands (user, position),
        writes) if every use of D's tensors is one the rewrite keeps exact."""
        zeros, whole, writes = {name + ":0"}, set(), []
        frontier = [name + ":0"]
        while frontier:
            t = frontier.pop()
            if t in self.outputs:
                return None     # read outside the step (a count per class it returns)
            for user, pos in self.users[t]:
                node = self.nodes[user]
                if node.op in ZERO_KEEPING:
                    made = [user + ":0"]
                elif node.op == "IdentityN":
                    made = [f"{user}:{pos}"]
                elif node.op == "Mul" or (node.op == "RealDiv" and pos == 0):
                    other = _tensor(node.input[1 - pos])
                    if other in zeros:
                        if node.op == "RealDiv":
                            return None
                    elif self.shape(other) == shape:
                        whole.add((user, 1 - pos))
                    elif self.shape(other).rank != 0:
                        return None
                    made = [user + ":0"]
                elif node.op in WRITES and pos == 1 and \
                        self.variable_shape(node.input[0]) == shape:
                    writes.append(user)
                    made = []
                elif node.op == "Sum" and pos == 0 and self._every_axis(node, shape.rank):
                    made = []
                else:
                    return None
                for m in made:
                    if m not in zeros:
                        zeros.add(m)
                        frontier.append(m)
        whole = {(u, p) for u, p in whole if _tensor(self.nodes[u].input[p]) not in zeros}
        return zeros, whole, writes

    def _every_axis(self, node, rank: int) -> bool:
        axes = self.nodes.get(node.input[1].split(":")[0])
        if axes is None or axes.op != "Const":
            return False
        values = np.ravel(tf.make_ndarray(axes.attr["value"].tensor)) % rank
        return sorted(set(values.tolist())) == list(range(rank))

    def _unique_of(self, ids: str, scope: str | None = None) -> str:
        """The Unique of `ids` and its size, made once per ids tensor, under
        `scope` (the first sum's: the ids' own may be the autodiff's)."""
        if ids in self.unique:
            return self.unique[ids]
        base = f"{scope}/parallax_rows"
        unique = tf.compat.v1.NodeDef(name=f"{base}/unique", op="Unique", input=[ids])
        unique.attr["T"].type = self.dtype(ids)
        unique.attr["out_idx"].type = tf.int32.as_datatype_enum
        size = tf.compat.v1.NodeDef(name=f"{base}/unique/size", op="Size",
                                    input=[f"{base}/unique:0"])
        size.attr["T"].type = self.dtype(ids)
        size.attr["out_type"].type = tf.int32.as_datatype_enum
        self.add(unique)
        self.add(size)
        self.unique[ids] = unique.name
        return unique.name

    def _rows_of(self, tensor: str, shape, ids: str, user: str) -> str:
        """`tensor` (of the table's shape) at the distinct ids, for `user`:
        moved there in place where `user` is its one use, else gathered."""
        if (tensor, ids) in self.rows:
            return self.rows[tensor, ids]
        name = tensor.split(":")[0]
        node = self.nodes[name]
        only_use = [u for u, _ in self.users[tensor]] == [user] and not any(
            self.users[t] for t in self.users if t != tensor and t.split(":")[0] == name)
        unique = self._unique_of(ids)
        if only_use and node.op == "ReadVariableOp":
            handle, dtype = node.input[0], node.attr["dtype"].type
            controls = [i for i in node.input if i.startswith("^")]
            node.Clear()
            node.name, node.op = name, "ResourceGather"
            node.input.extend([handle, f"{unique}:0", *controls])
            node.attr["dtype"].type = dtype
            node.attr["Tindices"].type = self.dtype(ids)
            node.attr["batch_dims"].i = 0
            node.attr["validate_indices"].b = True
            return tensor
        ins = [(pos, _tensor(i)) for pos, i in enumerate(node.input) if not i.startswith("^")]
        if only_use and node.op in MOVABLE and all(
                self.shape(i) == shape or self.shape(i).rank == 0 for _, i in ins):
            for pos, i in ins:
                if self.shape(i) == shape:
                    node.input[pos] = self._rows_of(i, shape, ids, name)
            return tensor
        base = f"{name}/parallax_rows"
        axis = tf.compat.v1.NodeDef(name=f"{base}/axis", op="Const")
        axis.attr["dtype"].type = tf.int32.as_datatype_enum
        axis.attr["value"].tensor.CopyFrom(tf.make_tensor_proto(0, tf.int32))
        gather = tf.compat.v1.NodeDef(name=base, op="GatherV2",
                                      input=[tensor, f"{unique}:0", axis.name])
        gather.attr["Tparams"].type = self.dtype(tensor)
        gather.attr["Tindices"].type = self.dtype(ids)
        gather.attr["Taxis"].type = tf.int32.as_datatype_enum
        gather.attr["batch_dims"].i = 0
        self.add(axis)
        self.add(gather)
        self.rows[tensor, ids] = gather.name + ":0"
        return gather.name + ":0"
