"""Facts: the analyses of one user graph that the planner and the passes
both ask for, each computed once per variable.

- `column_uses(var)`: how a table is used, for a cut by columns
  (column_cut.py);
- `deferral(var)`, `dense_deferral(var)`: a table's (a dense variable's)
  update math, for applying it a step later (deferral.py);
- `coalescing(var)`: whether a sparse gradient may leave a worker with its
  rows summed (coalescing.py);
- `stages()`: each gradient's stage in the step (packing.py), for every
  candidate plan's packing;
- `normalization(batch_norm)`: batch normalization's lines and exchanges
  (graph/normalization.py), for every plan.
A ConfigError is remembered too: every later ask raises it again.

Requires: a TrainingGraph. Guarantees: one Facts per graph is made by the
build (parallax_ng/build.py) and given to the planner and to the passes
(`PassContext.facts`); what it answers depends on the graph alone.
"""
from __future__ import annotations

from ..errors import ConfigError
from ..graph import normalization
from . import coalescing, column_cut, deferral, packing


class Facts:
    def __init__(self, tg):
        self.tg = tg
        self._known: dict[tuple[str, str], object] = {}

    def _once(self, kind: str, var: str, compute):
        key = (kind, var)
        if key not in self._known:
            try:
                self._known[key] = compute()
            except ConfigError as e:
                self._known[key] = e
        found = self._known[key]
        if isinstance(found, ConfigError):
            raise ConfigError(str(found))
        return found

    def column_uses(self, var: str) -> column_cut.ColumnUses:
        return self._once("columns", var, lambda: column_cut.uses(self.tg, var))

    def deferral(self, var: str) -> deferral.Deferral:
        return self._once("deferral", var, lambda: deferral.analyse(self, var))

    def dense_deferral(self, var: str) -> deferral.Deferral:
        return self._once("dense deferral", var, lambda: deferral.analyse_dense(self.tg, var))

    def stages(self) -> dict[str, int]:
        return self._once("stages", "", lambda: packing.stages(self.tg))

    def runs(self) -> dict[str, int]:
        return self._once("runs", "", lambda: packing.runs(self.tg))

    def reached_runs(self) -> dict[str, frozenset[int]]:
        return self._once("reached runs", "", lambda: packing.reached_runs(self.tg,
                                                                           self.runs()))

    def coalescing(self, var: str) -> tuple[str, ...] | None:
        return self._once("coalescing", var, lambda: coalescing.coalescing(self.tg, var))

    def normalization(self, batch_norm: str) -> tuple[tuple[str, ...], tuple]:
        return self._once("normalization", batch_norm,
                          lambda: normalization.planned(self.tg, batch_norm))
