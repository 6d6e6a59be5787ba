"""Columns: can a variable be cut by columns over the replicas, and what
must change where it is used?

EmbRace (section 4.1) keeps an embedding table [V, D] as one part per
replica of the job: replica j holds columns [c_j, c_j + d_j) of every row
(`placement.Columns`). Its optimizer slots of the same shape are cut alike.
A replica then trains its own columns: its update ops run as written, on
narrower tensors, since they act on every element alike (a product with
the learning rate, a square root) or row by row (a scatter-add of rows).
What needs the whole width changes:
- a lookup (ResourceGather) whose rows leave that element-wise region (the
  model reads them) becomes an exchange: every replica gathers its columns
  for every replica's ids and an AlltoAll hands each replica the full rows
  of its own ids (transforms/columns.py, parallax_ng/comm/collectives.py);
- a read of the whole value that leaves it (a fetch, a checkpoint, a tied
  output layer) reads every part and puts them side by side; an If that
  gives the variable or its initial value (`initialized_value()`) gives
  the replica's columns of either where only they are used;
- a write of a whole-width value (an initializer, a restore) writes the
  replica's columns of it; VariableShape gives the whole shape;
- the gradient's rows reach each replica with its columns only (an
  AlltoAll, transforms/aggregate.py); where they leave the element-wise
  region through `L2Loss` (a global norm), each replica's share is added
  over the replicas. Any other way out is an error naming the op.

Requires: a TrainingGraph. Guarantees: `uses(tg, var)` returns a
`ColumnUses` or raises ConfigError naming the op, the variable and what
would be accepted; it is the same on every worker.
"""
from __future__ import annotations

from dataclasses import dataclass

import tensorflow as tf

from ..errors import ConfigError
from ..graph import rules
from ..graph.frontend import TrainingGraph
from ..graph.ir import TensorRef

# Ops whose every output element is a function of the same element of each
# input (inputs of rank 0 broadcast): they act on a replica's columns as on
# the whole variable.
ELEMENTWISE = frozenset({
    "Identity", "Snapshot", "StopGradient", "Neg", "Abs", "Sign", "Sqrt", "Rsqrt", "Square",
    "Exp", "Log", "Log1p", "Reciprocal", "Inv", "Cast", "Floor", "Ceil", "Round", "Tanh",
    "Sigmoid", "Relu", "ZerosLike", "OnesLike", "Add", "AddV2", "Sub", "Mul", "MulNoNan",
    "RealDiv", "Div", "DivNoNan", "Maximum", "Minimum", "Pow", "SquaredDifference",
    "ClipByValue", "Select", "SelectV2", "Greater", "GreaterEqual", "Less", "LessEqual",
    "Equal", "NotEqual", "LogicalAnd", "LogicalOr", "LogicalNot", "IsFinite",
})
# Ops that move whole rows: column-cut data in position 0 stays column-cut.
ROW_OPS = frozenset({"UnsortedSegmentSum", "GatherV2", "Gather", "SparseSegmentSum",
                     "SparseSegmentMean", "SparseSegmentSqrtN"})
ASSIGNS = frozenset({"AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"})
ACCEPTED = ("ReadVariableOp, ResourceGather, VariableShape, VarIsInitializedOp, "
            "AssignVariableOp, AssignAdd/SubVariableOp, ResourceScatter*, "
            "ResourceSparseApply*, ResourceApply*")


@dataclass(frozen=True)
class ColumnUses:
    var: str
    state: tuple[str, ...]             # the variable and its slots of its shape
    lookups: tuple[str, ...]           # ResourceGathers whose rows leave: full rows by AlltoAll
    whole_reads: tuple[str, ...]       # ReadVariableOps whose value leaves: the parts joined
    cut: tuple[tuple[str, int], ...]   # (writer, input) of a whole-width value: its columns
    shapes: tuple[str, ...]            # VariableShape ops: the whole shape
    norms: tuple[str, ...]             # L2Loss of gradient rows: shares added over replicas
    selects: dict                      # If op -> its branches' `Branch`es (then, else)
    whole_selects: tuple[str, ...] = ()  # those whose value leaves: every part joined


def uses(tg: TrainingGraph, var: str) -> ColumnUses:
    """The uses of `var`, or a ConfigError naming the one that cannot be cut
    (the planner and the passes ask Facts.column_uses, which asks once)."""
    v = tg.variables[var]
    grad = tg.gradients.get(var)
    if grad is None or not grad.sparse:
        raise ConfigError(f"alltoall cuts {var!r} by columns and exchanges the rows of its "
                          "gradient, which is dense; use allreduce, ps or bfb for it")
    if tg.ir.node(var).op != "VarHandleOp":
        raise ConfigError(f"alltoall needs a resource variable; {var!r} is a reference "
                          "variable (tf.compat.v1 with resource variables off); create it "
                          "with use_resource=True, or use ps or allgather for it")
    if len(v.shape) != 2 or any(d is None for d in v.shape):
        raise ConfigError(f"alltoall cuts a [rows, columns] table by columns; {var!r} has "
                          f"shape {list(v.shape)}; use ps or allgather for it")
    state = tuple(s for s in tg.owned(var) if tg.variables[s].shape == v.shape)
    ops = {}
    for s in state:
        for op in list(tg.readers.get(s, ())) + list(tg.writers.get(s, ())):
            ops[op] = s
    seeds, shapes, writers, selects = {}, [], set(), {}
    for op in sorted(ops):
        kind = tg.ir.node(op).op
        if kind == "ReadVariableOp" or kind == "ResourceGather" and not _batch_dims(tg, op):
            seeds[TensorRef(op, 0)] = op
        elif kind == "VariableShape":
            shapes.append(op)
        elif kind in ASSIGNS or kind.startswith(("ResourceScatter", "ResourceSparseApply",
                                                 "ResourceApply")):
            writers.add(op)
        elif kind in ("If", "StatelessIf") and (branches := _selected_read(tg, op)):
            selects[op] = branches
            seeds[TensorRef(op, 0)] = op
        elif kind != "VarIsInitializedOp":
            raise ConfigError(f"op {op!r} ({kind}) uses {ops[op]!r}, which alltoall cuts by "
                              f"columns over the replicas; it knows {ACCEPTED}; use ps or "
                              f"allgather for {var!r}")
    seeds[grad.values] = "gradient"
    handles = set(state)
    bad: set[str] = set()
    while True:
        region, norms, failed = _region(tg, seeds, bad, grad.values, handles, writers)
        if "gradient" in failed:
            op = failed["gradient"]
            raise ConfigError(
                f"the gradient of {var!r} reaches op {op!r} ({tg.ir.node(op).op}), which "
                "alltoall cannot give one replica's columns: the rows may go only through "
                "element-wise ops with scalars, row sums, sparse applies and L2Loss (a "
                f"global norm); use ps or allgather for {var!r}")
        if not failed:
            break
        bad |= set(failed)
    lookups = tuple(sorted(op for op in bad if tg.ir.node(op).op == "ResourceGather"))
    whole = tuple(sorted(op for op in bad if tg.ir.node(op).op == "ReadVariableOp"))
    _check_late_reads(tg, var, whole, ops, writers, grad.values)
    cut = []
    for w in sorted(writers):
        for pos, ref in enumerate(tg.ir.data_inputs(w)):
            if ref in region or tg.variable_of_handle(ref) is not None:
                continue
            t = tg.tensor(ref)
            if t.shape.rank == 0 or not t.dtype.is_floating:
                continue
            if _restored(tg, ref):     # a Saver's restore: the whole variable, checked
                cut.append((w, pos))   # by the restore itself when it runs
                continue
            if t.shape.rank is None or tf.compat.dimension_value(t.shape[-1]) != v.shape[1]:
                raise ConfigError(f"op {w!r} ({tg.ir.node(w).op}) writes {ops[w]!r} with "
                                  f"{ref.node} of shape {t.shape}, which alltoall cannot cut "
                                  f"to a replica's columns of {v.shape[1]}; use ps or "
                                  f"allgather for {var!r}")
            cut.append((w, pos))
    return ColumnUses(var, state, lookups, whole, tuple(cut), tuple(shapes), tuple(norms),
                      selects, tuple(sorted(op for op in bad if op in selects)))


def _check_late_reads(tg, var: str, whole, ops: dict, writers: set, gradient: TensorRef):
    """A whole read that the step's update of `var`'s state takes in (a
    norm over the variable or a slot: LAMB's trust ratio) runs after the
    gradient's exchange, while the other replicas write their columns: it
    would join parts some replicas have written and some not. (A read in
    the forward pass comes before the exchange, which every write waits
    for; a read no write takes in runs in runs of its own.)"""
    step = {w for w in writers if w != tg.variables[ops[w]].initializer}
    fed = tg.ir.ancestors(step, data_only=True)
    forward = tg.ir.ancestors({gradient.node})
    late = [r for r in whole if r in fed and r not in forward]
    if late:
        raise ConfigError(
            f"op {late[0]!r} reads the whole of {ops[late[0]]!r} in the update of {var!r} "
            "after the gradient's exchange (e.g. LAMB's trust ratio, a constraint, or an "
            "accumulated gradient read whole): alltoall cuts it "
            "by columns, and in the update each replica writes its own while the others "
            f"read them; use ps or allgather for {var!r}")


RESTORES = frozenset({"RestoreV2", "Restore", "RestoreSlice"})


def _restored(tg, ref: TensorRef) -> bool:
    """Whether `ref` is a value read from a checkpoint (through Identity ops):
    what a tf.compat.v1.train.Saver's restore assigns, of unknown shape."""
    seen = 0
    while seen < 8:
        kind = tg.ir.node(ref.node).op
        if kind in RESTORES:
            return True
        if kind != "Identity":
            return False
        ref, seen = tg.ir.data_inputs(ref.node)[0], seen + 1
    return False


@dataclass(frozen=True)
class Branch:
    """What a branch of an If returns: a read of its handle argument `arg`
    ("read"), or argument `arg` as it is ("pass")."""
    kind: str
    arg: int


def _selected_read(tg, op: str) -> tuple[Branch, Branch] | None:
    """(then, else) when If `op` returns, in each branch, a read of one of its
    handle arguments or one argument unchanged (TensorFlow's
    `initialized_value()`: the variable if it is initialized, else its
    initial value, as ExponentialMovingAverage initializes its shadows)."""
    node = tg.ir.node(op)
    library = {f.signature.name: f for f in (tg.ir.library.function if tg.ir.library else ())}
    out = []
    for key in ("then_branch", "else_branch"):
        f = library.get(node.attr[key].func.name)
        branch = _branch(f) if f is not None else None
        if branch is None:
            return None
        out.append(branch)
    return tuple(out)


def _branch(f) -> Branch | None:
    args = [a.name for a in f.signature.input_arg]
    if len(f.ret) != 1:
        return None
    nodes = {n.name: n for n in f.node_def}
    ref, read = next(iter(f.ret.values())), False
    while True:
        name = ref.split(":")[0]
        if name in args:
            return Branch("read" if read else "pass", args.index(name))
        n = nodes.get(name)
        if n is None or n.op not in ("Identity", "ReadVariableOp") or read and \
                n.op == "ReadVariableOp":
            return None
        read = read or n.op == "ReadVariableOp"
        ref = n.input[0]


def _batch_dims(tg, op) -> int:
    nd = tg.ir.node(op)
    return nd.attr["batch_dims"].i if "batch_dims" in nd.attr else 0


def _region(tg, seeds: dict, bad: set, gradient: TensorRef, handles: set, writers: set):
    """Tensors that hold one replica's columns (from the seeds not in `bad`,
    through element-wise and row ops), the L2Loss ops of gradient rows, and
    the seeds whose columns leave the region: {seed op or "gradient": the op
    where they leave}."""
    origin = {ref: {name} for ref, name in seeds.items() if name not in bad}
    norms, failed = [], {}
    for ref, name in seeds.items():      # read for the caller: the user fetches it
        if name not in bad and name != "gradient" and not tg.ir.node_consumers.get(name):
            failed[name] = name
    for name in tg.ir.topo_order:
        inputs = tg.ir.data_inputs(name)
        hit = [(pos, ref) for pos, ref in enumerate(inputs) if ref in origin]
        if not hit:
            continue
        node = tg.ir.node(name)
        came = set().union(*(origin[ref] for _, ref in hit))
        if rules.is_autodiff(name) and all(ref == gradient for _, ref in hit):
            continue    # the autodiff's own use of its output
        op = node.op
        others = [ref for ref in inputs if ref not in origin]
        if name in writers and all(tg.variable_of_handle(r) in handles for r in inputs
                                   if tg.variable_of_handle(r) is not None):
            continue    # a replica's columns written into its part
        if op == "L2Loss" and came == {"gradient"}:
            norms.append(name)
            continue
        if op in ELEMENTWISE and all(_scalar(tg, r) for r in others):
            for i in range(len(tg.graph.get_operation_by_name(name).outputs)):
                origin[TensorRef(name, i)] = came
            continue
        if op == "IdentityN":
            for pos, ref in hit:
                origin[TensorRef(name, pos)] = origin[ref]
            continue
        if op in ROW_OPS and [pos for pos, _ in hit] == [0]:
            origin[TensorRef(name, 0)] = came
            continue
        for seed in came:
            failed.setdefault(seed, name)
    return set(origin), sorted(set(norms)), failed


def _scalar(tg, ref: TensorRef) -> bool:
    return tg.tensor(ref).shape.rank == 0
