"""Deferred updates: the nodes a pass makes to apply a table's update outside
its step, on every replica (prefetch: a step later, rows the next batch
reads first; horizontal: a step later, block by block).

Requires: a deferral.Deferral the planner accepted, the pass context.
Guarantees: `Nodes` makes variables, reads, assigns and traced functions on
replica k's device, copies changed nodes, clones the update math
(`_clone`), and makes the pending state clear on every write of the table
that is not the update (`_clear_on_writes`).
"""
from __future__ import annotations

import tensorflow as tf

from parallax_ng.errors import GraphError
from parallax_ng.graph import emit
from parallax_ng.graph.ir import TensorRef, copy_node, format_input, parse_input
from parallax_ng.planning import deferral


class Nodes:
    """New nodes on replica devices, and copies of changed ones (shared by
    the passes that apply an update a step later: prefetch, horizontal)."""

    def __init__(self, ir, ctx, d: deferral.Deferral, changed: dict, added: list):
        self.ir, self.ctx, self.d, self.changed, self.added = ir, ctx, d, changed, added
        tg = ctx.tg
        self.grad = tg.gradients[d.var]
        self.state = [s for s in tg.owned(d.var) if tg.variables[s].shape ==
                      tg.variables[d.var].shape]
        self.dtype = tg.variables[d.var].dtype.base_dtype
        self.n = ctx.plan.num_replicas
        self.pending: list[dict] = []     # per replica: key -> (handle, dtype)

    def _node(self, name, op, inputs, k, **attrs) -> str:
        self.added.append(emit.node_def(name, op, inputs, self.ctx.plan.devices[k], **attrs))
        return name

    def _variable(self, name, dtype, shape, k) -> str:
        shape = tf.compat.v1.AttrValue(shape=tf.TensorShape(shape).as_proto())
        return self._node(name, "VarHandleOp", [], k, dtype=dtype, shape=shape, container="",
                          shared_name=name)

    def _read(self, handle, dtype, k, controls=()) -> str:
        return self._node(f"{handle}/read", "ReadVariableOp", [handle, *controls], k,
                          dtype=dtype)

    def _assign(self, name, handle, value, dtype, k, controls=()) -> str:
        return self._node(name, "AssignVariableOp", [handle, value, *controls], k, dtype=dtype,
                          validate_shape=False)

    def _traced(self, fn, inputs, scope, k):
        made, outs = emit.emit_traced(fn, inputs, scope, self.ctx.plan.devices[k])
        self.added.extend(made)
        return outs

    def _copy(self, name):
        if name not in self.changed:
            self.changed[name] = copy_node(self.ir.node(name))
        return self.changed[name]

    def _shared_read(self, k, key) -> str:
        """One read per step of pending variable `key` (the parts share it)."""
        h, dtype = self.pending[k][key]
        name = f"{h}/read"
        if not any(a.name == name for a in self.added):
            self._read(h, dtype, k)
        return name

    def _keep_scalar(self, k, at, i, ref, controls) -> str:
        """Scalar `ref` of the step kept for the next: a copy (a reference
        variable's read aliases its buffer, which the step's later writes
        change in place)."""
        h, dtype = self.pending[k][f"scalar_{i}"]
        copy = self._node(f"{at}/scalar_{i}/copy", "Snapshot",
                          [self.ctx.replica_tensor(k, ref)], k, T=dtype)
        return self._assign(f"{at}/scalar_{i}", h, copy, dtype, k, controls)

    def _clone(self, k, at: str, inputs, controls=()) -> dict:
        """The update math of replica k copied under `at/apply/`: a data
        input of the user's op is the copy's when the math makes it, else
        `inputs(ref)` (the gradient, a handle, a kept scalar); every copy
        waits for the writes it followed and for `controls`. Returns op ->
        its copy."""
        ctx, d, tg = self.ctx, self.d, self.ctx.tg
        clone = {op: f"{at}/apply/{op}" for op in d.ops}
        for op in d.ops:
            nd = copy_node(self.ir.node(ctx.replica_name(k, op)))
            nd.name = clone[op]
            del nd.input[:]
            for text in tg.ir.node(op).input:
                src, idx, control = parse_input(text)
                if control:
                    if src in clone:
                        nd.input.append("^" + clone[src])
                    continue
                ref = TensorRef(src, idx)
                if src in clone:
                    nd.input.append(format_input(clone[src], idx))
                elif ref in d.constants:
                    nd.input.append(ctx.replica_tensor(k, ref))
                elif ref in d.frontier:
                    nd.input.append(self._shared_read(k, f"scalar_{d.frontier.index(ref)}"))
                else:
                    got = inputs(ref)
                    if got is None:
                        raise GraphError(f"input {ref} of {op!r} is not in the analysis of "
                                         f"{d.var!r}'s update")
                    nd.input.append(got)
            nd.input.extend(["^" + clone[w] for w in d.after[op]] + list(controls))
            self.added.append(nd)
        return clone

    def _clear_on_writes(self, clear: list) -> None:
        """Every write of the variable or a slot but the update's (an
        initializer, a restore) forgets the pending step first."""
        tg, ctx = self.ctx.tg, self.ctx
        for s in self.state:
            for w in tg.writers.get(s, ()):
                if w in self.d.ops:
                    continue
                for k in range(self.n):
                    name = ctx.replica_name(k, w)
                    if name in self.ir:
                        self._copy(name).input.append("^" + clear[k])
