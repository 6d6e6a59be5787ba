"""Replicate: one copy of the user's graph per replica.

Requires: a PassContext whose plan says which variables are shared.
Guarantees:
- replica 0 keeps the user's node names; replica k > 0 is `parallax/replica_k/<name>`;
- shared variables, their writers and ops with effects outside the graph
  (checkpoint writes) exist once, and every replica's references lead to them;
- copies get their own resource names (`shared_name`), loop frames and
  colocation groups, so replicas never alias each other's state;
- every replica's random ops carry the seeds the plan's random streams
  give its job-wide index (parallax_ng/graph/randomness.py), in functions too;
  a distinct stateless op of replica r > 0 reads its seed XORed with r's mask;
- replicas that read shared state keep the single-device order of reads and
  writes: a shared writer runs after every replica's copy of each read of the
  same variable that is its ancestor in the user's graph (otherwise replica k
  could read a value that replica 0's step already advanced).
"""
from __future__ import annotations

from dataclasses import dataclass

from parallax_ng.graph import branches, emit, randomness, rules
from parallax_ng.graph.ir import GraphIR, copy_node, format_input


@dataclass(frozen=True)
class ReplicatePass:
    name: str = "replicate"
    requires: tuple = ()
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        n = ctx.plan.num_replicas
        once = ctx.unreplicated
        functions = _FunctionCopies(ir.library, ctx)
        out = []
        for node in ir.nodes:
            out.append(_first_replica(node, ctx, functions))
            if node.name in once:
                continue
            parsed = ir.parsed_inputs(node)
            for k in range(1, n):
                out.append(_copy(node, k, ctx, parsed, functions))
        out, masked = _mask_stateless_seeds(out, ir, ctx, n)
        extra = _order_shared_writers(ir, ctx, n)
        nodes = []
        for node in out:
            if node.name in extra:
                node = _with_controls(node, extra[node.name])
            nodes.append(node)
        report = {"replicas": n, "copied": (len(ir) - len(once)) * (n - 1),
                  "once": len(once), "ordering_edges": sum(map(len, extra.values())),
                  "function_copies": len(functions.made), "stateless_masked": masked}
        return GraphIR.from_nodes(nodes, ir).replace(library=functions.new_library()), report


def _copy(node, k: int, ctx, parsed, functions):
    nd = type(node)()
    nd.CopyFrom(node)
    nd.name = ctx.replica_name(k, node.name)
    if parsed:
        del nd.input[:]
        nd.input.extend(format_input(ctx.replica_name(k, src), idx) for src, idx, _ in parsed)
    if "shared_name" in nd.attr and nd.attr["shared_name"].s:
        nd.attr["shared_name"].s = nd.name.encode()
    if "frame_name" in nd.attr:
        nd.attr["frame_name"].s = (ctx.replica_name(k, "") +
                                   nd.attr["frame_name"].s.decode()).encode()
    _retarget_colocation(nd, k, ctx)
    functions.retarget(nd, k)
    _seed(nd, node.name, k, ctx)
    return nd


def _first_replica(node, ctx, functions):
    """Replica 0's node: the user's, unless its seeds or the functions it
    calls differ for this worker's replica 0."""
    if node.name not in ctx.plan.random and not functions.calls_copied(node, 0):
        return node
    nd = copy_node(node)
    functions.retarget(nd, 0)
    _seed(nd, node.name, 0, ctx)
    return nd if nd != node else node


def _seed(nd, key: str, k: int, ctx) -> None:
    """Set the seeds of random op `nd` (plan key `key`) for local replica k."""
    mode = ctx.plan.random.get(key)
    if mode is None or not randomness.is_random(nd):
        return
    seed, seed2 = randomness.seeds(key, mode, nd.attr["seed"].i, nd.attr["seed2"].i,
                                   ctx.plan.replica_offset + k)
    nd.attr["seed"].i, nd.attr["seed2"].i = seed, seed2


def _mask_stateless_seeds(out: list, ir: GraphIR, ctx, n: int) -> tuple[list, int]:
    """Every replica but the job's first reads a distinct stateless op's seed
    (a tf.random.Generator's state: its key) XORed with its mask
    (graph/randomness.py): a Const and a BitwiseXor on the op's device, the
    op's seed input rewired to them."""
    todo = {}
    for key, mode in ctx.plan.random.items():
        state = key in ir and randomness.generator_read(ir.node(key))     # a generator's: its key
        at = 0 if state else randomness.seed_input(ir.node(key)) if key in ir else None
        if mode != "distinct" or at is None:
            continue
        seed = ctx.tg.tensor(ir.data_inputs(key)[at])
        for k in range(n):
            r = ctx.plan.replica_offset + k
            if r > 0:
                todo[ctx.replica_name(k, key)] = (at, r, seed.dtype,
                                                  state and seed.shape.as_list()[0])
    if not todo:
        return out, 0
    new = []
    for node in out:
        if node.name not in todo:
            new.append(node)
            continue
        at, r, dtype, words = todo[node.name]
        nd = copy_node(node)
        mask = emit.const(f"{nd.name}/parallax_seed_mask", randomness.key_mask(r, words)
                          if words else [randomness.seed_mask(r), 0], dtype, nd.device)
        xor = emit.node_def(f"{nd.name}/parallax_seed", "BitwiseXor",
                            [nd.input[at], mask.name], nd.device, T=dtype)
        nd.input[at] = xor.name
        new.extend([mask, xor, nd])
    return new, len(todo)


class _FunctionCopies:
    """Per-replica copies of functions whose bodies depend on the replica.

    A body that colocates ops with user nodes would pin every replica's call
    next to replica 0's variables: replica k > 0 gets a copy pinned next to
    its own (shared variables stay shared). A body with random ops gets a
    copy with the replica's seeds, for every replica whose seeds differ
    (replica 0 of a later worker too). A function that calls a copied
    function is copied as well.
    """

    def __init__(self, library, ctx):
        self.ctx = ctx
        self.library = library
        self.functions = {} if library is None else {f.signature.name: f
                                                      for f in library.function}
        self.pinned = {name for name, f in self.functions.items()
                       if any(_targets(nd) - ctx.unreplicated for nd in f.node_def)}
        self.made: dict[tuple[int, str], object] = {}
        self._needs: dict[tuple[int, str], bool] = {}

    def needs_copy(self, k: int, name: str) -> bool:
        key = (k, name)
        if key not in self._needs:
            self._needs[key] = False        # a recursive call does not decide
            f = self.functions[name]
            self._needs[key] = (k > 0 and name in self.pinned) or any(
                self._seeds_differ(k, name, nd) or self.calls_copied(nd, k)
                for nd in f.node_def)
        return self._needs[key]

    def calls_copied(self, nd, k: int) -> bool:
        return any(self.needs_copy(k, f) for f in _called(nd) if f in self.functions)

    def retarget(self, nd, k: int) -> None:
        """Point calls in `nd` at replica k's copies where there are any."""
        for value in nd.attr.values():
            funcs = [value.func] if value.HasField("func") else \
                list(value.list.func) if value.HasField("list") else []
            for f in funcs:
                if f.name in self.functions and self.needs_copy(k, f.name):
                    f.name = self._copy(k, f.name)

    def _seeds_differ(self, k: int, name: str, nd) -> bool:
        key = f"{name}/{nd.name}"
        mode = self.ctx.plan.random.get(key)
        if mode is None:
            return False
        old = (nd.attr["seed"].i, nd.attr["seed2"].i)
        return randomness.seeds(key, mode, *old, self.ctx.plan.replica_offset + k) != old

    def _copy(self, k: int, name: str) -> str:
        key = (k, name)
        if key not in self.made:
            f = type(self.functions[name])()
            f.CopyFrom(self.functions[name])
            f.signature.name = f"{name}_parallax_replica_{k}"
            self.made[key] = f
            for nd in f.node_def:
                if k > 0:
                    _retarget_colocation(nd, k, self.ctx)
                self.retarget(nd, k)
                _seed(nd, f"{name}/{nd.name}", k, self.ctx)
        return self.made[key].signature.name

    def new_library(self):
        if not self.made:
            return self.library
        out = type(self.library)()
        out.CopyFrom(self.library)
        out.function.extend(self.made.values())
        return out


def _called(nd) -> list[str]:
    """Names of the functions a node's attrs call."""
    out = []
    for value in nd.attr.values():
        if value.HasField("func"):
            out.append(value.func.name)
        elif value.HasField("list"):
            out.extend(f.name for f in value.list.func)
    return out


def _targets(nd) -> set[str]:
    if "_class" not in nd.attr:
        return set()
    return {loc.decode().removeprefix("loc:@") for loc in nd.attr["_class"].list.s}


def _retarget_colocation(nd, k: int, ctx) -> None:
    """Colocate with replica k's copies; drop groups of nodes that exist once."""
    if "_class" not in nd.attr:
        return
    locs = [("loc:@" + ctx.replica_name(k, t)).encode() for t in _targets(nd)
            if t not in ctx.unreplicated]
    del nd.attr["_class"]
    if locs:
        nd.attr["_class"].list.s.extend(sorted(locs))


def _order_shared_writers(ir: GraphIR, ctx, n: int) -> dict[str, list[str]]:
    """Control inputs that make each shared writer wait for replicas' reads.

    A read of a shared variable that runs before one of its writers in the
    user's graph (an ancestor of it) must run before that writer in every
    replica; a read inside a v1 tf.cond's branch (a lowered one's too:
    batch normalization's gamma read in both branches of its `training`
    cond) through the Merges that end its conds, since a control edge from
    the branch not taken would leave the writer dead: it did not run, and
    nothing said so. Ancestry is propagated once, in topological order, as bit sets
    over the reads concerned.
    """
    if n == 1:
        return {}
    shared = sorted(ctx.plan.shared_state())
    reads = {var: [r for r in _ordered_reads(ctx.tg, var) if r not in ctx.unreplicated]
             for var in shared}
    bit = {r: 1 << i for i, r in enumerate(r for rs in reads.values() for r in rs)}
    if not bit:
        return {}
    before: dict[str, int] = {}
    for name in ir.topo_order:
        mask = bit.get(name, 0)
        for src, _, _ in ir.parsed_inputs(ir.node(name)):
            mask |= before.get(src, 0)
        before[name] = mask
    extra: dict[str, list[str]] = {}
    memo: dict = {}
    for var in shared:
        for w in ctx.tg.writers.get(var, ()):
            earlier = [r for r in reads[var] if before[w] & bit[r]]
            if any(branches.switches_above(ir, r, memo) for r in earlier):
                earlier = sorted(branches.after_branches(ir, earlier, ir.ancestors([w]), memo))
            if earlier:
                extra.setdefault(w, []).extend(
                    "^" + ctx.replica_name(k, r) for r in earlier for k in range(1, n))
    return extra


def _ordered_reads(tg, var: str) -> list[str]:
    """The reads a shared writer waits for. A resource variable's cheap reads
    are snapshots (a later write copies the buffer first); ops such as a
    functional If that only receive the handle are left out. Every read of a
    reference variable counts (see TrainingGraph.reads)."""
    if tg.ir.node(var).op == "VarHandleOp":
        return [r for r in tg.reads(var) if tg.ir.node(r).op in rules.CHEAP_READERS]
    return tg.reads(var)


def _with_controls(node, controls: list[str]):
    nd = type(node)()
    nd.CopyFrom(node)
    have = set(nd.input)
    nd.input.extend(c for c in controls if c not in have)
    return nd
