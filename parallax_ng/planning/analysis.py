"""Analysis: one VariableInfo per trainable variable.

Requires: a TrainingGraph. Guarantees: shape, dtype, bytes, dense/sparse
(sparse when the gradient is an IndexedSlices), the fraction of rows touched
per step (alpha: estimated from static shapes, replaced by a measurement when
the runner has seen a step), and the variable's position in the forward pass
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

    def to_dict(self) -> dict:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype,
                "bytes": self.nbytes, "sparse": self.sparse, "alpha": self.alpha,
                "alpha_source": self.alpha_source, "order": self.order}


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
            order=min(reads, default=len(depth)))
    return out


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
