"""Deferral: can a table's update be applied later, row by row?

EmbRace's vertical scheduling (section 4.2.2) sends first the gradient rows
the next batch reads and the rest later, before they are read. Here a
step's update of a table cut by columns (`alltoall`) is split so: the step
runs the table's update math as written with no gradient rows (what every
row without a gradient gets: nothing, or Adam's decay of its moments), after
keeping the rows its batch touched as they were; the next step exchanges
the touched rows its own batch reads first and applies the update to them
before its lookup, and the rest while it runs (transforms/prefetch.py).
Applying the update to some rows later is the same update when the math
acts on each row alone: element-wise ops with scalars, reads and writes of
the table and its slots, sparse applies, and whatever the gradient's rows
go through (duplicate ids summed). The scalars it reads from the rest of
the step (the learning rate, Adam's bias corrections from its step
counters, a moving average's decay, a global norm's clip scale) are kept
from the step that made the gradient, so a delayed row gets its own
step's values (the paper's Adam step counter). A global norm over the
rows stays in their step: aggregate sums it from each replica's rows.

Requires: a TrainingGraph and a variable the planner cuts by columns.
The planner asks `prefetch` and `horizontal_blocks` which variables' updates
wait (a note on each that may not, saying why).
Guarantees: `analyse(facts, var)` returns a `Deferral` or raises
ConfigError naming the op, the variable and what would be accepted (the
planner and the passes ask planning/facts.py, which asks once).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..config import Config
from ..errors import ConfigError
from ..graph import rules
from ..graph.frontend import TrainingGraph
from ..graph.ir import TensorRef
from ..methods import method
from . import column_cut as columns
from .plan import VariablePlan

# Ops that may see a row of the table or a slot: each output row is a
# function of the same row of those inputs and of scalars.
ROW_WISE = columns.ELEMENTWISE | {"IdentityN", "ReadVariableOp", "ResourceGather", "NoOp"}


@dataclass(frozen=True)
class Deferral:
    var: str
    lookup: str                         # the lookup whose distinct ids the gradient's rows are
    ops: tuple[str, ...]                # the update math, in topological order
    writers: tuple[str, ...]            # its writes of the table and its slots
    frontier: tuple[TensorRef, ...]     # scalars it reads from the rest of the step
    constants: tuple[TensorRef, ...]    # constants it reads (the same every step)
    needs: dict                         # writer -> the frontier scalars it depends on
    after: dict                         # op -> the writers it follows (by any path)


def same_ids(facts, var: str, distinct: bool, coalesce: bool) -> str | None:
    """The one lookup of `var` whose distinct ids, in the order they first
    appear, are the rows its coalesced gradient sends (the gradient's
    indices are the lookup's ids, flattened), when lookups and gradients
    both go distinct; else None."""
    tg = facts.tg
    found = facts.column_uses(var).lookups
    grad = tg.gradients[var]
    if not (distinct and coalesce and len(found) == 1):
        return None
    handle, ids = tg.ir.data_inputs(found[0])[:2]
    flat = tg.ir.node(grad.indices.node)
    if tg.variable_of_handle(handle) != var or flat.op != "Reshape" or \
            tg.ir.data_inputs(grad.indices.node)[0] != ids:
        return None
    return found[0]


# -- what the plan defers ---------------------------------------------------
SPLIT = ("a job step with servers beside collectives runs them in two session runs, "
         "and an update that waits for the next step needs one; without servers it can")
SEVERAL = ("the graph's train ops update apart (a GAN's two `minimize` ops, run in turn): "
           "an update that waits for the next run may be read by the other's first")


def _several(facts) -> bool:
    """Whether the trained variables are updated by several train ops
    (planning/packing.py `runs`)."""
    return len(set(facts.runs().values())) > 1


def horizontal_blocks(facts, variables: dict, config: Config, split: bool = False):
    """(blocks, notes): with `horizontal_scheduling`, the dense variables
    aggregated by all-reduce whose update may wait a step
    (parallax_ng/planning/deferral.py), grouped by layer (the name's scope) and in
    the order the forward pass first reads them; a note on each that may
    not, saying why."""
    if not config.horizontal_scheduling:
        return (), {}
    tg = facts.tg
    first, notes = {}, {}
    for v, vp in variables.items():
        if not method(vp.method).horizontal or vp.info.sparse:
            continue
        if split or _several(facts):
            notes[v] = f"no horizontal scheduling: {SPLIT if split else SEVERAL}"
            continue
        try:
            facts.dense_deferral(v)
        except ConfigError as e:
            notes[v] = f"no horizontal scheduling: {e}"
            continue
        reads = [tg.ir.topo_index[r] for r in tg.readers.get(v, ())
                 if r not in tg.after_gradients]
        first[v] = min(reads, default=len(tg.ir.topo_index))
    blocks: dict[str, list[str]] = {}
    for v in sorted(first, key=lambda v: (first[v], v)):
        blocks.setdefault(v.rpartition("/")[0] or v, []).append(v)
    ordered = sorted(blocks.values(), key=lambda b: first[b[0]])
    return tuple(tuple(b) for b in ordered), notes


def prefetch(facts, vp: VariablePlan, config: Config, split: bool = False) -> VariablePlan:
    """`vp` with prefetch on where the config asks for it and the table's
    update may wait for the next step (parallax_ng/planning/deferral.py), else with
    a note saying why not."""
    if not config.prefetch or not vp.info.sparse:
        return vp
    if not method(vp.method).columns:
        return vp.noted(f"no prefetch: it applies to alltoall, not {vp.method}")
    if not (vp.coalesce and config.distinct_lookups):
        return vp.noted("no prefetch: it needs coalesce_rows and distinct_lookups")
    if split or _several(facts):
        return vp.noted(f"no prefetch: {SPLIT if split else SEVERAL}")
    try:
        facts.deferral(vp.name)
    except ConfigError as e:
        return vp.noted(f"no prefetch: {e}")
    return replace(vp, prefetch=True)


# -- the update math ---------------------------------------------------------
def analyse(facts, var: str) -> Deferral:
    """The update math of table `var`, applied row by row a step later."""
    tg = facts.tg
    uses = facts.column_uses(var)
    lookup = same_ids(facts, var, True, True)
    if lookup is None:
        raise ConfigError(f"prefetch splits {var!r}'s gradient by the ids of one lookup; its "
                          f"lookups are {list(uses.lookups)} and its gradient's rows are not "
                          "one lookup's ids (or coalesce_rows/distinct_lookups are off)")
    # a global norm's L2Loss of the rows: each replica's share of the squares,
    # summed over the replicas, in the rows' own step (aggregate); the clip
    # scale it makes is one of the scalars kept for the delayed rows
    norms = set(uses.norms) | set(facts.coalescing(var) or ())
    return _math(tg, var, set(uses.state), lookup, "prefetch", row_wise=True, norms=norms)


def analyse_dense(tg: TrainingGraph, var: str) -> Deferral:
    """The update of dense variable `var`, applied whole a step later
    (horizontal scheduling, transforms/horizontal.py)."""
    grad = tg.gradients.get(var)
    if grad is None or grad.sparse:
        raise ConfigError(f"horizontal scheduling delays dense gradients; {var!r}'s "
                          "is sparse or missing")
    norms = [c for c, _ in tg.ir.consumers.get(grad.values, ())
             if tg.ir.node(c).op == "L2Loss"]
    if norms:
        raise ConfigError(f"horizontal scheduling applies {var!r}'s update in the "
                          f"next step, but a global norm reads its gradient in this "
                          f"one ({norms[0]!r}, clip_by_global_norm)")
    shape = tg.variables[var].shape
    state = {s for s in tg.owned(var) if tg.variables[s].shape == shape}
    return _math(tg, var, state, "", "horizontal scheduling", row_wise=False)


def _math(tg: TrainingGraph, var: str, state: set, lookup: str, what: str,
          row_wise: bool, norms: set = frozenset()) -> Deferral:
    """The ops of the step that update `state` from `var`'s gradient (with
    `row_wise`, only if each row's update reads that row alone); `norms`:
    L2Loss ops of the gradient that stay in its step (what they feed is
    read as a scalar of the step)."""
    grad = tg.gradients[var]
    ends = {r.node for r in (grad.values, grad.indices) if r is not None}
    step = {w for s in state for w in tg.writers.get(s, ()) if w in tg.after_gradients}
    within = tg.ir.ancestors(step)
    writers = {w for s in state for w in tg.writers.get(s, ()) if w in within}
    # row-bearing: what reads the table or a slot, or the gradient, in the
    # update (not the forward's reads, which the gradients come from)
    forward = tg.before_gradients
    seeds = {r for s in state for r in tg.readers.get(s, ()) if r in within and
             r not in forward}
    rows = _forward(tg, seeds | ends, within - norms - forward)
    feeding = tg.ir.ancestors(writers, stop=lambda n: n in ends, data_only=True)
    ops = ({op for op in rows if op in feeding} | writers) - ends
    from_state = _forward(tg, {r for r in seeds if r in ops}, ops)
    frontier, constants = set(), set()
    for op in ops:
        kind = tg.ir.node(op).op
        if row_wise and op in from_state and kind not in ROW_WISE and op not in writers:
            raise ConfigError(f"op {op!r} ({kind}) updates {var!r} from its rows; {what} "
                              "applies some rows a step later, which needs row-wise math "
                              f"(element-wise ops, reads, writes, sparse applies); turn "
                              f"{what} off")
        for ref in tg.ir.data_inputs(op):
            if ref.node in ends or ref.node in ops or tg.variable_of_handle(ref) in state:
                continue
            if tg.ir.node(ref.node).op == "Const":
                constants.add(ref)
            elif tg.tensor(ref).shape.rank == 0:
                frontier.add(ref)
            else:
                raise ConfigError(f"op {op!r} ({kind}) updates {var!r} with {ref}, of shape "
                                  f"{tg.tensor(ref).shape}; {what} keeps only scalars from "
                                  f"a step for its delayed update; turn {what} off")
    for ref in (grad.values, grad.indices):
        outside = [c for c, _ in tg.ir.consumers.get(ref, ())
                   if c not in ops and c not in norms and not rules.is_autodiff_use(tg.ir.node(c))
                   ] if ref is not None else []
        if outside:
            raise ConfigError(f"{what} delays {var!r}'s gradient, which {outside[0]!r} "
                              f"reads besides its update; turn {what} off")
    order = [op for op in tg.ir.topo_order if op in ops]
    needs, after = {}, {}
    for op in order:
        before = tg.ir.ancestors([op]) - {op}
        after[op] = tuple(w for w in order if w in writers and w in before)
        if op in writers:
            inside = tg.ir.ancestors([op], stop=lambda n: n not in ops, data_only=True)
            needs[op] = tuple(sorted(r for r in frontier if r.node in inside))
    return Deferral(var, lookup, tuple(order), tuple(w for w in order if w in writers),
                    tuple(sorted(frontier)), tuple(sorted(constants)), needs, after)


def _forward(tg: TrainingGraph, seeds: set, within: set) -> set:
    """Nodes of `within` reached from `seeds` by data edges (seeds included)."""
    out, todo = set(), list(seeds)
    while todo:
        name = todo.pop()
        if name in out:
            continue
        out.add(name)
        todo.extend(c for c, _ in _out_edges(tg, name) if c in within)
    return out


def _out_edges(tg: TrainingGraph, name: str):
    node = tg.graph.get_operation_by_name(name)
    for i in range(len(node.outputs)):
        yield from tg.ir.consumers.get(TensorRef(name, i), ())

