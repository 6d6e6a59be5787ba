"""The autodiff's gradient of a forward `Mean` or `Sum` over the batch: found
by the names tf.gradients gives its ops (`gradients/<op>_grad/...`), or in
a traced step's GradientTape by the scope of the layer the op is in, and
the incoming gradient read where the gradient spreads it over the rows
(`Reshape`, `Tile` or `BroadcastTo`; a Mean's then `RealDiv` by the
count). Batch normalization's statistics (graph/normalization.py) are
exchanged with their gradients so, as are means and sums over the batch
that a program applies to its rows (`(z - mean) / std` by hand, a masked
mean, `tf.nn.l2_normalize` over the batch) under `batch_norm: synchronized`.

Requires: a tf.Graph with its gradient ops. Guarantees: reads the graph
only.
"""
from __future__ import annotations

import re

import tensorflow as tf

from .rules import AUTODIFF_SCOPE, past_identities, tails

_SPREADS = ("Tile", "BroadcastTo")
_LEADING = re.compile(r"(gradients(_\d+)?|gradient_tape)/")


class Autodiff:
    """The autodiff's ops by the forward op their names are for:
    tf.gradients' `gradients/<op>_grad/...`, and a tape's
    `gradient_tape/<op's scope>/...` (every op of the scope's), each by
    the gradient it is part of (what precedes the autodiff's scope: a
    nested tf.function's gradient, inlined, is `PartitionedCall/gradients/
    <op>_grad/...` where its forward op is `StatefulPartitionedCall/<op>`)."""

    def __init__(self, graph: tf.Graph):
        self.named, self.taped = {}, {}     # {forward name: {gradient's prefix: [ops]}}
        self.reads = {}                     # gradient's prefix: the tensors its ops read
        for op in graph.get_operations():
            if (found := _last(op.name)) is None:
                continue
            rest = op.name[found.end():]
            while (inner := _LEADING.match(rest)) is not None:    # Adam/gradients/gradients/
                rest = rest[inner.end():]
            prefix = op.name[:len(op.name) - len(rest)]
            self.reads.setdefault(prefix, set()).update(past_identities(i).ref()
                                                        for i in op.inputs)
            if "_grad/" in rest:
                self.named.setdefault(rest.split("_grad/", 1)[0], {}) \
                    .setdefault(prefix, []).append(op)
            if found.group(2) == "gradient_tape":
                self.taped.setdefault(rest.rsplit("/", 1)[0] if "/" in rest else "", {}) \
                    .setdefault(prefix, []).append(op)

    def of(self, mean, x) -> list:
        """`mean`'s gradient ops by tf.gradients' names, else its scope's
        in a tape (the layer's other statistic's too), else, for a forward
        op in an inlined call, those named for its name past the call's
        scope: of the gradients whose ops read the statistics' input `x`
        (the gradient of its variance reads it), so a call of the same
        layer elsewhere (in the step, in another call) is not taken for
        it."""
        return [op for ops in self.each(mean, x) for op in ops]

    def each(self, mean, x) -> list[list]:
        """The ops `of` finds, by the gradient they are part of: a forward
        op two losses are differentiated through (a GAN's discriminator on
        the generated rows, in its loss and the generator's) has one
        gradient in each."""
        scope = mean.name.rsplit("/", 1)[0] if "/" in mean.name else ""
        for table, name in ((self.named, mean.name), (self.taped, scope),
                            *((self.named, tail) for tail in tails(mean.name)),
                            *((self.taped, tail) for tail in tails(scope))):
            reading = [ops for prefix, ops in table.get(name, {}).items()
                       if past_identities(x).ref() in self.reads[prefix]]
            if reading:
                return reading
        return []


    def named_each(self, op) -> list[list]:
        """The ops tf.gradients named for `op`, by the call that made them."""
        return list(self.named.get(op.name, {}).values())


def _last(name: str):
    """The last autodiff scope in op `name` (a gradient's own gradient, an
    inlined gradient function's), or None."""
    found = None
    for found in AUTODIFF_SCOPE.finditer(name):
        pass
    return found


def chains(ops) -> list[tuple]:
    """(Reshape, spread, RealDiv) of the Mean gradients among `ops`; the
    spread in the Reshape's place where the Mean keeps its dimensions
    (its gradient spreads the incoming one as it is)."""
    out = []
    for op in ops:
        if op.type != "RealDiv" or op.inputs[0].op.type not in _SPREADS:
            continue
        spread = op.inputs[0].op
        reshape = spread.inputs[0].op
        out.append((reshape if reshape.type == "Reshape" else spread, spread, op))
    return out


def incoming(index: Autodiff, mean: tf.Operation) -> tuple[tf.Tensor, ...] | None:
    """The gradients the autodiff gives `mean`'s output (the input of its
    Mean gradient's Reshape), one in each gradient that reaches it, where
    each holds exactly one Mean gradient for it (in a tape's scope, which
    holds several Means' gradients, the one whose divisor counts the
    Mean's input); None where none is found or one is not."""
    found = _chains(index, mean)
    return tuple(c[0].inputs[0] for c in found) if found else None


def division(index: Autodiff, mean: tf.Operation) -> tuple[tf.Operation, ...] | None:
    """The autodiff's divisions of `mean`'s spread gradient by its count
    (input 1: a constant where the graph fixes the shapes), one in each
    gradient `incoming` finds; None where it finds none."""
    found = _chains(index, mean)
    return tuple(c[2] for c in found) if found else None


def _chains(index: Autodiff, mean: tf.Operation) -> list[tuple] | None:
    x = mean.inputs[0]
    each = [chains(ops) for ops in index.each(mean, x)]
    each = [[c for c in found if _counts(c[2].inputs[1], past_identities(x))]
            if len(found) > 1 else found for found in each]   # a tape's scope: the one
    if not any(each) and x.shape.is_fully_defined():          # that counts x's entries;
        each = [chains(ops) for ops in index.named_each(mean)]  # a static shape's: divided
    if each and all(len(found) == 1 for found in each):       # by a constant, not reading x
        return [found[0] for found in each]
    return None


def incoming_sum(index: Autodiff, total: tf.Operation, groups=None,
                 fed: bool = False) -> tuple[tf.Tensor, ...] | None:
    """The gradients the autodiff gives Sum `total`'s output, one in each
    gradient that reaches it: the input of the one spread (after a
    Reshape, unless the Sum keeps its dimensions) over `total`'s input's
    shape that no division follows (a Mean's gradient is a Sum's divided
    by the count), among its ops (`Autodiff.each`, or `groups`: each
    gradient's ops); with `fed`, what the spread takes (the Reshape's output:
    this Sum's alone, where the gradient it reshapes may go on to
    others); None where none is found or one is not."""
    x, out = past_identities(total.inputs[0]), []
    for group in index.each(total, total.inputs[0]) if groups is None else groups:
        found = [op for op in group
                 if op.type in _SPREADS and (_counts(op.inputs[1], x) or _fixed(op, x)) and
                 not any(c.type == "RealDiv" for c in op.outputs[0].consumers())]
        if len(found) != 1:
            return None
        spread = found[0].inputs[0]
        out.append(spread if fed or spread.op.type != "Reshape" else spread.op.inputs[0])
    return tuple(out) or None


def _fixed(spread: tf.Operation, x: tf.Tensor) -> bool:
    """Whether `spread` gives x's shape, which the graph fixes (a batch of
    static size: the autodiff spreads by constants)."""
    return x.shape.is_fully_defined() and spread.outputs[0].shape == x.shape and \
        tf.get_static_value(spread.inputs[1]) is not None


def _counts(count: tf.Tensor, x: tf.Tensor, most: int = 8) -> bool:
    """Whether the Mean gradient's divisor `count` reads tf.shape(x), within
    `most` ops."""
    stack, seen = [(count.op, 0)], set()
    while stack:
        op, depth = stack.pop()
        if op.type in ("Shape", "Size"):      # another tensor's shape: not past it into
            if past_identities(op.inputs[0]) is x:      # its values (which may read a
                return True                             # row count of x's: `sum / n`)
            continue
        if depth < most and op.name not in seen:
            seen.add(op.name)
            stack.extend((i.op, depth + 1) for i in op.inputs)
    return False


def incoming_segments(index: Autodiff, total: tf.Operation) -> tuple[tf.Tensor, ...] | None:
    """The gradients the autodiff gives UnsortedSegmentSum `total`'s output
    (a sum per class), one in each gradient that reaches it: what its
    gradient gathers back to the rows at the ids (clipped at 0, as
    tf.math.unsorted_segment_sum's gradient drops negative ids); None
    where a gradient holds no such gather, or several."""
    ids, out = past_identities(total.inputs[1]), []
    for group in index.each(total, ids):
        found = [op for op in group if op.type == "GatherV2" and
                 op.inputs[1].op.type == "Maximum" and
                 past_identities(op.inputs[1].op.inputs[0]) is ids and
                 op.inputs[0].shape.rank == total.outputs[0].shape.rank]
        if len(found) != 1:
            return None
        out.append(found[0].inputs[0])
    return tuple(out) or None
