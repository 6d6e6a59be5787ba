"""Writes of state inside conditionals and function calls: where the
replicas could take different branches, or where a write is out of the
passes' reach.

Two forms. tf.cond and tf.while_loop lowered to Switch/Merge (TF1 control
flow, `disable_v2_behavior`, and TF2 steps as graph/tracing.py captures
them): an op inside a branch runs only where the Switch's predicate sends
it (`switches_above`). Functional ops (If, Case, While, PartitionedCall:
tf.cond and tf.while_loop in a graph built with TF2 behavior, a
tf.function called in one) run a function from the graph's library, whose
writes to a variable handle it takes no pass sees (`function_writes`).

`check_updates` refuses a trained variable's update where its gradient
cannot be aggregated: in a loop, or in a function. For the state sync
(transforms/state_sync.py), given which tensors differ between replicas:
`check_one_branch` refuses a write of mirrored state under a predicate
that differs, `warn_out_of_reach` warns of writes inside functions from
such values.

Requires: the graph's IR (graph/ir.py, with the function library).
Guarantees: pure functions of the graph (check_updates raises GraphError).
"""
from __future__ import annotations

import warnings

from ..errors import GraphError
from . import randomness, rules, variance

# functional op -> its inputs before the functions' arguments (a predicate, a branch index)
FUNCTIONAL = {"If": 1, "StatelessIf": 1, "Case": 1, "StatelessCase": 1, "While": 0,
              "StatelessWhile": 0, "PartitionedCall": 0, "StatefulPartitionedCall": 0}
_FUNCTION_ATTRS = ("then_branch", "else_branch", "branches", "body", "cond", "f")
_SWITCHES = ("Switch", "RefSwitch")
_MERGES = ("Merge", "RefMerge")
_LEFT = _MERGES + ("Exit", "RefExit")        # where a branch's or a loop's values leave it


def check_updates(tg) -> None:
    """A GraphError where a trained variable's update sits where its
    gradient cannot be aggregated: inside a while loop, or inside a
    functional op's function."""
    _updates_in_loops(tg)
    _updates_in_functions(tg)


def warn_out_of_reach(tg, varies) -> None:
    """A warning where a functional op (a tf.while_loop of TF2 behavior) writes a
    variable from values that differ between replicas: no pass reaches
    into its function to sync the write, so each replica keeps its own."""
    found = sorted({(var, op) for var, op in tg.function_writes
                    if any(varies(ref) for ref in tg.ir.data_inputs(op))})
    if found:
        warnings.warn(
            f"variables {[v for v, _ in found]} are written inside ops "
            f"{sorted({op for _, op in found})} (While, Case or a call: a "
            "tf.while_loop, tf.case or tf.function call in a graph built with TF2 behavior) "
            "from values that differ between replicas; no pass reaches a "
            "write inside a function, so each replica keeps its own value (replica 0's is "
            "the one fetched and saved). To have them synced, write them outside the loop "
            "or call, from its outputs", stacklevel=3)


def warn_in_loops(looped=(), means=()) -> None:
    """A warning where writes (variable, writer) or exchanged values (the
    tensors `means`: a program's all-reduce, a statistic) inside a v1 while
    loop's body are not synced: an exchange runs once a step (a second
    would wait for ever), the body every turn."""
    what = (f"variables {sorted({v for v, _ in looped})} are written inside a tf.while_loop's "
            f"body (by {sorted({w for _, w in looped})})" if looped else
            f"values {sorted(means)} that the replicas would exchange (a synchronized batch "
            "normalization's sums, a mean of the batch) are computed inside a tf.while_loop's "
            "body")
    if looped or means:
        warnings.warn(
            f"{what} from values that differ between replicas: an exchange runs once a "
            "step, and the body every turn, so each replica keeps its own (replica 0's "
            "value is the one fetched and saved; batch normalization in a recurrent cell "
            "keeps each replica's statistics). To have them synced, compute them outside "
            "the loop, from its outputs", stacklevel=3)


def check_no_exchange_in_loops(ir) -> None:
    """A GraphError where a pass put an exchange between replicas (a
    collective op) inside a v1 while loop's body: it runs once a step, the
    body every turn, so the second turn's would wait until the run's
    timeout. (The passes keep exchanges out of loops; this names any that
    one missed instead of a hang.)"""
    inside = randomness.in_loops(ir)
    for node in ir.nodes:
        if node.op.startswith(("Collective", "Nccl", "Horovod")) and any(
                r.node in inside and ir.node(r.node).op not in ("Exit", "RefExit")
                for r in ir.data_inputs(node.name)):
            raise GraphError(
                f"the step would exchange {node.name!r} ({node.op}) inside a while loop's "
                "body, where an exchange between replicas runs once a step and the body "
                "every turn (the second turn's would wait); compute what it exchanges "
                "outside the loop, from the loop's outputs")


def check_one_branch(tg, varies, var: str, writer: str, memo: dict) -> None:
    """A GraphError where a write of a mirrored variable sits in a branch
    (or loop) whose predicate differs between replicas: they would take
    different branches, so their copies would part (a value the replicas
    share, written on some only) or the sync of a written value would wait
    for replicas that never reach it."""
    for switch in switches_above(tg.ir, writer, memo):
        pred = tg.ir.data_inputs(switch)[1]
        if decided_apart(tg, switch, varies):
            raise GraphError(
                f"variable {var!r} is written by {writer!r} inside a tf.cond branch or while "
                f"loop whose predicate {pred.node!r} differs between replicas (it depends on "
                "their data): they would take different branches, and the replicas' copies "
                "would part (or the sync of a value written from their data would wait for "
                "replicas that never reach it). One device decides on the global batch; "
                "compute the predicate from values the replicas share (aggregated gradients, "
                "a step counter), or write the variable outside the cond")


def decided_apart(tg, switch: str, varies) -> bool:
    """Whether the replicas could take different sides of Switch `switch`:
    its predicate differs between them (`varies`, of a TensorRef) beyond
    their batches' shapes."""
    pred = tg.ir.data_inputs(switch)[1]
    return varies(pred) and not variance.by_shapes_only(tg, pred.node)


def switches_above(ir, node: str, memo: dict | None = None) -> list[str]:
    """The Switch ops whose branch (or loop body) `node` runs in: those its
    data and control inputs reach back to without passing a Merge or an
    Exit, where a branch's or a loop's values leave it. `memo` (a dict kept between calls on one
    graph) holds what each op above reaches, so asking for every writer
    walks the graph once."""
    memo = {} if memo is None else memo
    found = {node} if ir.node(node).op in _SWITCHES else set()
    for name in _inputs(ir, node):
        found |= _above(ir, name, memo)
    return sorted(found)


def after_branches(ir, nodes, within=None, memo: dict | None = None) -> set[str]:
    """Ops to wait on for `nodes` where a control edge from one inside a
    tf.cond's branch not taken would stop the waiting op too (a dead input
    is catching): a node outside branches itself, one inside the Merges in
    `within` (None: any) after it where its conds end, outside every branch (they run
    whichever branch is taken, after the taken branch's ops they read)."""
    memo = {} if memo is None else memo
    out = set()
    for node in nodes:
        if not switches_above(ir, node, memo):
            out.add(node)
            continue
        out |= {d for d in ir.descendants([node])
                if (within is None or d in within) and ir.node(d).op in _MERGES and not any(
                    switches_above(ir, i, memo) for s in _merged(ir, d, memo)
                    for i in _inputs(ir, s))}
    return out


def _merged(ir, merge: str, memo: dict) -> set[str]:
    """The Switch ops of the branches Merge `merge` ends."""
    return set().union(*(switches_above(ir, i, memo) for i in _inputs(ir, merge)))


def _above(ir, start: str, memo: dict) -> frozenset:
    """The Switch ops `start` and its inputs reach without passing a Merge
    or an Exit (none from either; a loop's way back goes through a Merge)."""
    stack, open_ = [start], set()
    while stack:
        name = stack[-1]
        if name in memo:
            stack.pop()
            continue
        op = ir.node(name).op
        inputs = [] if op in _LEFT else _inputs(ir, name)
        pending = [i for i in inputs if i not in memo and i not in open_]
        if pending and name not in open_:
            open_.add(name)
            stack.extend(pending)
            continue
        found = set().union(*(memo.get(i, ()) for i in inputs))
        if op in _SWITCHES:
            found.add(name)
        memo[name] = frozenset(found)
        open_.discard(name)
        stack.pop()
    return memo[start]


def _inputs(ir, name: str) -> list[str]:
    return [i.lstrip("^").split(":")[0] for i in ir.node(name).input]


def function_writes(tg) -> list[tuple[str, str]]:
    """(variable, functional op) where the op's function writes the
    handle of the variable it takes (a tf.cond of TF2 behavior whose branch
    assigns it)."""
    library = {f.signature.name: f for f in getattr(tg.ir.library, "function", ())}
    if not library:
        return []
    out = []
    for node in tg.ir.nodes:
        skip = FUNCTIONAL.get(node.op)
        if skip is None:
            continue
        for pos, ref in enumerate(tg.ir.data_inputs(node.name)):
            var = tg.variable_of_handle(ref) if pos >= skip else None
            if var is not None and any(writes(library, f, pos - skip, 0)
                                       for f in functions(node.attr)):
                out.append((var, node.name))
    return out


def functions(attr) -> list[str]:
    names = []
    for key in _FUNCTION_ATTRS:
        if key in attr:
            value = attr[key]
            names += [value.func.name] if value.func.name else [f.name for f in value.list.func]
    return names


def writes(library: dict, name: str, arg: int, depth: int = 0,
           writer=rules.is_writer) -> bool:
    """Whether function `name` writes the handle it takes as argument `arg`
    (through Identity ops and the functions it calls in turn) by an op
    whose type `writer` accepts."""
    f = library.get(name)
    if f is None or arg >= len(f.signature.input_arg) or depth > 20:
        return False
    handles = {f.signature.input_arg[arg].name}
    grown = True
    while grown:            # the handle under the Identity ops that pass it on
        grown = False
        for nd in f.node_def:
            if nd.op == "Identity" and nd.name not in handles and \
                    nd.input and nd.input[0].split(":")[0] in handles:
                handles.add(nd.name)
                grown = True
    for nd in f.node_def:
        at = [k for k, i in enumerate(nd.input) if not i.startswith("^")
              and i.split(":")[0] in handles]
        if not at:
            continue
        if writer(nd.op):
            return True
        skip = FUNCTIONAL.get(nd.op)
        if skip is not None and any(writes(library, g, k - skip, depth + 1, writer)
                                    for k in at if k >= skip for g in functions(nd.attr)):
            return True
    return False


def _updated_in(tg, var: str, op: str) -> bool:
    """Whether functional op `op`'s functions write variable `var` by an
    op other than an assignment (an optimizer's update)."""
    library = {f.signature.name: f for f in tg.ir.library.function}
    node, skip = tg.ir.node(op), FUNCTIONAL[tg.ir.node(op).op]
    return any(writes(library, f, pos - skip, 0, lambda kind: rules.is_writer(kind) and
                      kind not in rules.STATE_SYNC_REDUCTION)
               for pos, ref in enumerate(tg.ir.data_inputs(op))
               if pos >= skip and tg.variable_of_handle(ref) == var
               for f in functions(node.attr))


def _updates_in_loops(tg) -> None:
    """A GraphError if a trained variable is updated, or its gradient taken,
    inside a while loop (there, it cannot be aggregated: the step would
    hang). A variable without a gradient that only assignments write is
    state, trainable or not (a tf.Variable's default; a counter): its
    writes in a loop are state_sync's (the same on every replica, or named
    in a warning)."""
    entered = any(n.op in ("Enter", "RefEnter") for n in tg.ir.nodes)
    loops = randomness.in_loops(tg.ir) if entered else ()
    for var in sorted(tg.trainable):
        grad = tg.gradients.get(var)
        if grad is None and all(tg.ir.node(w).op in rules.STATE_SYNC_REDUCTION
                                for w in tg.writers.get(var, ())):
            continue
        for w in [*tg.writers.get(var, ()), *([grad.values.node] if grad else [])]:
            if w in loops and tg.ir.node(w).op not in ("Exit", "RefExit"):
                raise GraphError(
                    f"variable {var!r} is updated, or its gradient taken, inside a loop ({w!r} "
                    "runs in a while loop: a `for` over tf.range in a TF2 step, tf.while_loop),"
                    " where the replicas' gradients cannot be aggregated; loop in Python (over "
                    "`range`, unrolled in the step, summing the gradients) or outside the step")


def _updates_in_functions(tg) -> None:
    """A GraphError if a trainable variable (but state: `_updates_in_loops`)
    is written inside a functional op's function (an optimizer's update in
    a tf.while_loop or a tf.function call built with TF2 behavior;
    graph/cond_lowering.py lowers an If that writes), where its gradient
    cannot be aggregated."""
    for var, op in tg.function_writes:      # (assigned alone, no gradient: state)
        if tg.variables[var].trainable and (var in tg.gradients or _updated_in(tg, var, op)):
            kind = tg.ir.node(op).op
            fix = ("loop in Python, or apply the gradients outside the loop" if "While" in kind
                   else "apply the gradients outside it")
            raise GraphError(
                f"trainable variable {var!r} is written inside op {op!r} ({kind}: a "
                "tf.while_loop, tf.case or tf.function call in a graph built with TF2 "
                f"behavior), where parallax_ng cannot reach its update to aggregate the "
                f"gradient; {fix}")
