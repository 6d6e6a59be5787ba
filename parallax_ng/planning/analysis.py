"""Analysis: one VariableInfo per trainable variable.

Requires: a TrainingGraph. Guarantees: shape, dtype, bytes, dense/sparse
(sparse when the gradient is an IndexedSlices), the fraction of rows touched
per step (alpha: estimated from static shapes, replaced by a measurement when
the runner has seen a step; then also which rows, `touched`), and the variable's position in the forward pass
(layer order, used for fusion order later).
"""
from __future__ import annotations

from dataclasses import dataclass

from .. import compat
from ..graph.frontend import TrainingGraph


@dataclass(frozen=True)
class VariableInfo:
    name: str
    shape: tuple
    dtype: str
    nbytes: int
    sparse: bool
    alpha: float | None       # rows touched per step / rows (sparse only)
    alpha_source: str         # "estimate", "measured" or "dense"
    order: int                # depth where the variable first meets the batch
    factors: tuple | None = None  # (rows or None, width) of the MatMul factors (dense)
    known: bool = True        # the shape is fully defined: it can be packed flat
    touched: tuple = ()       # sorted sample of the distinct rows a worker's step touched

    @property
    def weighable_factors(self) -> bool:
        """A product of factors whose rows are known (the graph's or a
        measured step's): its factors' cost can be weighed (unknown rows
        would look free)."""
        return bool(self.factors and self.factors[0])

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "bytes": self.nbytes, "sparse": self.sparse, "alpha": self.alpha,
                "alpha_source": self.alpha_source, "order": self.order,
                "factors": list(self.factors) if self.factors else None}


def analyze(tg: TrainingGraph) -> dict[str, VariableInfo]:
    depth = forward_depths(tg)
    variant = tg.variant
    out = {}
    for name, grad in tg.gradients.items():
        var = tg.variables[name]
        reads = [depth[u] for r in tg.readers.get(name, ())
                 for u in [r, *tg.ir.node_consumers.get(r, ())] if u in variant]
        alpha = _estimate_alpha(tg, grad, var) if grad.sparse else 1.0
        out[name] = VariableInfo(
            name=name, shape=var.shape, dtype=var.dtype.name, nbytes=var.nbytes,
            sparse=grad.sparse, alpha=alpha,
            alpha_source="estimate" if grad.sparse else "dense",
            order=min(reads, default=len(depth)), factors=factors(tg, grad), known=var.known)
    return out


def factors(tg: TrainingGraph, grad) -> tuple | None:
    """(rows, width) of one replica's two factors where its dense gradient
    is a product `MatMul(a, b, transpose_a=True)` of 2-D tensors (a dense
    layer's weights: a = the layer's input rows, b = the gradient of its
    output): the rows they share (None where the graph does not know them;
    a measured step gives them, planning/profile.py) and the columns of a
    and b together. The sum over replicas of a_k^T b_k is
    [a_1; ...; a_N]^T [b_1; ...; b_N], so the factors can cross the network
    instead of the gradient (sufficient factors: Xie et al. 2015, Poseidon
    2017). None for any other gradient."""
    node = product(tg, grad)
    if node is None:
        return None
    a, b = (tg.tensor(r).shape for r in tg.ir.data_inputs(node.name)[:2])
    if a.rank != 2 or b.rank != 2:
        return None
    m, n = compat.dim(a, 1), compat.dim(b, 1)
    if None in (m, n):
        return None
    return compat.dim(a, 0) or compat.dim(b, 0), m + n


def unknown_rows(tg: TrainingGraph, info: dict) -> dict[str, str]:
    """Variable -> the name of its first factor (replica 0's), for the
    variables whose factors' rows the graph does not know: a measured step
    fetches them (planning/profile.py `measure`)."""
    return {v: str(tg.ir.data_inputs(product(tg, tg.gradients[v]).name)[0])
            for v, vi in sorted(info.items()) if vi.factors and vi.factors[0] is None}


def product(tg: TrainingGraph, grad):
    """The MatMul(a, b, transpose_a=True) node a dense gradient is (through
    Identity ops: the autodiff's tuples), or None."""
    if grad.sparse:
        return None
    ref = tg.ir.past_identities(grad.values)
    node = tg.ir.node(ref.node)
    if node.op != "MatMul" or ref.index != 0 or not node.attr["transpose_a"].b or \
            node.attr["transpose_b"].b:
        return None
    return node


def forward_depths(tg: TrainingGraph) -> dict[str, int]:
    """Longest data path from a source to each node: its place in the forward pass."""
    depth: dict[str, int] = {}
    for name in tg.ir.topo_order:
        depth[name] = 1 + max((depth.get(r.node, 0) for r in tg.ir.data_inputs(name)),
                              default=-1)
    return depth


def _estimate_alpha(tg: TrainingGraph, grad, var) -> float | None:
    """Upper bound from static shapes: lookups per step / rows (None if unknown)."""
    rows = var.shape[0] if var.shape else None
    n = compat.dim(tg.tensor(grad.indices).shape, 0)
    if not rows or n is None:
        return None
    return min(1.0, n / rows)


def with_measured_alpha(info: dict[str, VariableInfo], measured: dict[str, float]):
    """A copy of `info` where measured sparsity replaces the estimate."""
    from dataclasses import replace
    return {k: (replace(v, alpha=measured[k], alpha_source="measured")
                if k in measured else v) for k, v in info.items()}
