"""Variance: which nodes of a user's graph compute a different value on each
replica.

Requires: a TrainingGraph (duck-typed: its IR, gradient tensors and graph).
Guarantees: `replica_variant` is every node downstream of a per-replica
source (input pipelines, queue reads, split placeholders, random ops,
stateless ones and tf.random.Generator's draws included) along
data edges, a loop's back edges included (a value a while loop carries
from the data: an RNN's outputs), gradients aside (the transformation
aggregates them);
`is_input_source` says which ops give each replica its own data;
`whole_feeds` which placeholders every replica is fed alike.
"""
from __future__ import annotations

from .. import compat
from . import batch, randomness, rules


def replica_variant(tg, identical: frozenset[str] = frozenset(),
                    synced: frozenset = frozenset()) -> Variant:
    """User nodes whose outputs differ between replicas.

    Sources: input pipelines, placeholders with an unknown leading dimension
    (their feeds are split by replica), random ops, stateful or stateless
    (but those in `identical`, which every replica draws alike). Differences flow along
    data edges, except out of gradients, which the transformation aggregates,
    and into the inputs `synced` ((node, position): a state write's value the
    state-sync pass reduced over the replicas, a count each replica takes
    the job's of).
    """
    grads = tg.gradient_tensors
    variant = {node.name for node in tg.ir.nodes
               if node.name not in identical and _is_source(tg, node)}
    outputs = {}        # an IdentityN's varying outputs (its k-th passes its k-th input)
    todo = list(variant)
    while todo:           # along data edges, a loop's back edges too (NextIteration
        name = todo.pop()          # into its Merge: what a loop carries from the data)
        for user in tg.ir.node_consumers.get(name, ()):
            hit = {at for at, ref in enumerate(tg.ir.data_inputs(user))
                   if ref.node == name and ref not in grads and (user, at) not in synced
                   and ref.index in outputs.get(name, (ref.index,))}
            if tg.ir.node(user).op == "IdentityN" and not hit <= outputs.get(user, set()):
                outputs.setdefault(user, set()).update(hit)
                variant.add(user)
                todo.append(user)
            elif hit and user not in variant:
                variant.add(user)
                todo.append(user)
    return Variant(variant, outputs)


class Variant(frozenset):
    """The names of the nodes some output of which differs between
    replicas; `outputs` holds an IdentityN's outputs that do (tf.custom_gradient's
    gradients: the inputs' differ, the weights' are aggregated)."""

    def __new__(cls, names, outputs=None):
        out = super().__new__(cls, names)
        out.outputs = {k: frozenset(v) for k, v in (outputs or {}).items()}
        return out

    def varies(self, ref) -> bool:
        """Whether tensor `ref` differs between replicas."""
        return ref.node in self and ref.index in self.outputs.get(ref.node, (ref.index,))


def by_shapes_only(tg, name: str) -> bool:
    """Whether node `name` differs between replicas only through the shapes
    of their data (tf.shape, tf.size, tf.rank): tf_keras's RandomCrop
    compares the images' height and width with its crop under a tf.cond.
    The replicas of a training step get batches of one shape (the split
    is even), so they take the same branch; not where each replica pads
    its own batch (a sharded padded_batch)."""
    seen, todo = set(), [name]
    while todo:
        n = todo.pop()
        if n in seen or n not in tg.variant:
            continue
        seen.add(n)
        node = tg.ir.node(n)
        if node.op in _SHAPES:
            continue
        if _is_source(tg, node):
            return False
        todo.extend(ref.node for ref in tg.ir.data_inputs(n))
    return True


_SHAPES = frozenset({"Shape", "ShapeN", "Size", "Rank"})


def _is_source(tg, node) -> bool:
    return (is_input_source(tg, node) or randomness.is_random(node)
            or randomness.seed_input(node) is not None or randomness.generator_read(node))


def is_input_source(tg, node) -> bool:
    """True for ops that give each replica its own data: input pipelines,
    queue reads and placeholders whose feeds are split by replica (a first
    dimension unknown, but those fed whole, `whole_feeds`;
    or fixed in a batch the graph shows: TrainingGraph.fixed_batches)."""
    if node.op in rules.PER_REPLICA_SOURCES or node.op.startswith(rules.READ_PREFIXES):
        return True
    if node.op in ("Placeholder", "PlaceholderWithDefault"):
        shape = tg.graph.get_operation_by_name(node.name).outputs[0].shape
        return bool(shape.rank) and compat.dim(shape, 0) is None and \
            node.name not in whole_feeds(tg) or \
            node.name in getattr(tg, "fixed_batches", ()) or _sparse_shape(tg, node.name)
    return False


def feed_kinds(tg) -> dict:
    """graph/batch.py's `kinds(tg)`, read once per TrainingGraph (the
    whole feeds here, the runtime's feeds: runtime/fetches.py)."""
    if "feed_kinds" not in tg.__dict__:
        tg.__dict__["feed_kinds"] = batch.kinds(tg)
    return tg.__dict__["feed_kinds"]


def whole_feeds(tg) -> frozenset[str]:
    """The placeholders of an unknown first dimension fed whole to every
    replica (config `batch_feeds: {NAME: false}`, tg.batch_feeds, or
    graph/batch.py's whole where the config names them not): not
    per-replica sources (`is_input_source`). Read once per TrainingGraph."""
    if "whole_feeds" not in tg.__dict__:
        said = getattr(tg, "batch_feeds", {})
        tg.__dict__["whole_feeds"] = frozenset(
            [n for n, (kind, _) in feed_kinds(tg).items()
             if kind == batch.WHOLE and n not in said] +
            [n for n, split in said.items() if split is False])
    return tg.__dict__["whole_feeds"]


def _sparse_shape(tg, name: str) -> bool:
    """Whether placeholder `name` is a sparse placeholder's dense shape
    (NAME/shape beside NAME/indices and NAME/values): each replica is fed
    its own rows' count in it (runtime/fetches.py), so a count of the
    batch's rows read from it (Keras's loss tracker) is the replica's."""
    base, _, leaf = name.rpartition("/")
    return leaf == "shape" and all(tg.ir.get(f"{base}/{p}") is not None and
                                   tg.ir.node(f"{base}/{p}").op == "Placeholder"
                                   for p in ("indices", "values"))
