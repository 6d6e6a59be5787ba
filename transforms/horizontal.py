"""Horizontal: dense updates applied in the next step, block by block in
the order its forward pass reads them (EmbRace 4.2.1, horizontal scheduling).

Requires: the plan's `blocks` (dense variables aggregated by all-reduce,
grouped by layer, in forward order; parallax_ng/planning/deferral.py accepted each
one's update); runs after `aggregate` and the placement passes.
Guarantees, on every replica k:
- step t runs no update of a block's variables: it keeps the replica's own
  gradient of each, and the scalars the update reads from the step (the
  learning rate, Adam's step counters, a moving average's decay), and marks
  them pending;
- step t+1 begins with one all-reduce per block of the kept gradients, the
  blocks in forward order (each waits for the one before), so the first
  block's is done first; each variable's update (the user's ops, with the
  all-reduced gradient and step t's scalars) runs when it is pending, and
  the forward's first read of the variable waits for it; so the all-reduces
  of later blocks overlap the forward pass of earlier ones;
- `Deferred.flush` applies the pending step (the runner runs it before
  anything but a training step reads); `Deferred.clear` forgets it, and
  runs with every write that is not the update (an initializer, a restore).
Each variable's update runs once per step, in step order, on the
all-reduced gradient of its step: the result equals updating at once.
New nodes live under `parallax/horizontal/`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from parallax_ng.graph import emit
from parallax_ng.graph.ir import GraphIR
from parallax_ng.pipeline.results import Deferred
from transforms.deferred_updates import Nodes


@dataclass(frozen=True)
class HorizontalPass:
    name: str = "horizontal"
    requires: tuple = ("aggregate",)
    after: tuple = ("place", "init", "columns", "prefetch")

    def run(self, ir: GraphIR, ctx):
        changed, added, flush, clear = {}, [], [], []
        blocks = [[Update(ir, ctx, ctx.facts.dense_deferral(v), changed, added)
                   for v in block] for block in ctx.plan.blocks]
        for block in blocks:
            for u in block:
                u.make_pending()
        steps = _reduce(ctx, blocks, "step", added)
        for block, got in zip(blocks, steps):
            for u in block:
                u.this_step(got[u.d.var])
        flushed = _reduce(ctx, blocks, "flush", added)
        for k in range(ctx.plan.num_replicas):
            flush.append(_group(added, ctx, k, "flush", [
                u.flush(k, got[u.d.var][k]) for block, got in zip(blocks, flushed)
                for u in block]))
            clear.append(_group(added, ctx, k, "clear", [u.clears[k] for b in blocks
                                                         for u in b]))
        for b in blocks:
            for u in b:
                u.finish()
        previous = ctx.result(Deferred)
        if previous is not None:
            flush, clear = list(previous.flush) + flush, list(previous.clear) + clear
        ctx.publish(Deferred(tuple(flush), tuple(clear)))
        return ir.replace(changed, added), {"blocks": len(blocks),
                                            "variables": sum(map(len, blocks))}


def _group(added, ctx, k, name, ends) -> str:
    nd = emit.node_def(f"parallax/horizontal/replica_{k}/{name}", "NoOp",
                       ["^" + e for e in ends], ctx.plan.devices[k])
    added.append(nd)
    return nd.name


def _reduce(ctx, blocks, name, added) -> list[dict]:
    """Per block, in order, var -> per replica its all-reduced kept gradient
    (one all-reduce per block and dtype, each block after the one before)."""
    plan, out, before = ctx.plan, [], [None] * ctx.plan.num_replicas
    for b, block in enumerate(blocks):
        got = {}
        by_type = {}
        for u in block:
            by_type.setdefault(u.dtype, []).append(u)
        ends = []
        for t, (dtype, group) in enumerate(sorted(by_type.items(), key=lambda kv: kv[0].name)):
            scope = f"parallax/horizontal/{name}/block_{b}_{t}"
            packed = []
            for k in range(plan.num_replicas):
                grads = [u.kept(k) for u in group]
                made, (flat,) = emit.emit_traced(
                    lambda *g: tf.concat([tf.reshape(x, [-1]) for x in g], 0),
                    [(g, dtype, None) for g in grads], f"{scope}/replica_{k}/pack",
                    plan.devices[k])
                if before[k]:                  # the blocks' all-reduces in forward order
                    made.append(emit.node_def(f"{scope}/replica_{k}/in_order", "Identity",
                                              [flat, "^" + before[k]], plan.devices[k],
                                              T=dtype))
                    flat = made[-1].name
                added.extend(made)
                packed.append(flat)
            made, reduced = ctx.comm.all_reduce(f"{scope}/reduce", packed, dtype,
                                                plan.average_dense, gradient=True)
            added.extend(made)
            sizes = [int(np.prod(ctx.tg.variables[u.d.var].shape)) for u in group]
            for k in range(plan.num_replicas):
                shapes = [list(ctx.tg.variables[u.d.var].shape) for u in group]
                made, parts = emit.emit_traced(
                    lambda r: [tf.reshape(p, s) for p, s in zip(tf.split(r, sizes), shapes)],
                    [(reduced[k], dtype, [sum(sizes)])], f"{scope}/replica_{k}/unpack",
                    plan.devices[k])
                added.extend(made)
                for u, p in zip(group, parts):
                    got.setdefault(u.d.var, [None] * plan.num_replicas)[k] = p
            ends.append(reduced)
        before = [f"{scope}/replica_{k}/unpack/done" for k in range(plan.num_replicas)]
        for k in range(plan.num_replicas):
            added.append(emit.node_def(before[k], "NoOp",
                                       ["^" + e[k].split(":")[0] for e in ends],
                                       plan.devices[k]))
        out.append(got)
    return out


class Update(Nodes):
    """One dense variable's update, a step later, on every local replica."""

    def _scope(self, k):
        return f"parallax/horizontal/{self.d.var}/replica_{k}"

    def make_pending(self):
        """Replica k's pending step: its own gradient, whether there is one,
        the scalars."""
        tg = self.ctx.tg
        shape = list(tg.variables[self.d.var].shape)
        self.pending = []
        for k in range(self.n):
            at = f"{self._scope(k)}/pending"
            mine = {"gradient": (self._variable(f"{at}/gradient", self.dtype, shape, k),
                                 self.dtype),
                    "valid": (self._variable(f"{at}/valid", tf.bool, [], k), tf.bool)}
            for i, ref in enumerate(self.d.frontier):
                dtype = tg.tensor(ref).dtype.base_dtype
                mine[f"scalar_{i}"] = (self._variable(f"{at}/scalar_{i}", dtype, [], k), dtype)
            self.pending.append(mine)
        self.clears = [self._clear(k, "clear", []) for k in range(self.n)]

    def kept(self, k) -> str:
        return self._shared_read(k, "gradient")

    def _apply(self, k, name, gradient) -> str:
        """The user's update ops, with `gradient` and the kept scalars, run
        only if a step is pending; returns an op done either way."""
        ctx, tg = self.ctx, self.ctx.tg
        at = f"{self._scope(k)}/{name}"
        valid = self._shared_read(k, "valid")
        self._node(f"{at}/switch", "Switch", [valid, valid], k, T=tf.bool)
        taken = self._node(f"{at}/pending", "Identity", [f"{at}/switch:1"], k, T=tf.bool)
        skipped = self._node(f"{at}/none", "Identity", [f"{at}/switch:0"], k, T=tf.bool)
        handles = {s: ctx.replica_name(k, s) for s in self.state}

        def inputs(ref):
            if ref == self.grad.values:
                return gradient
            return handles.get(tg.variable_of_handle(ref))

        clone = self._clone(k, at, inputs, ["^" + taken])
        applied = self._node(f"{at}/applied", "Identity",
                             [taken] + ["^" + clone[w] for w in self.d.writers], k, T=tf.bool)
        return self._node(f"{at}/done", "Merge", [applied, skipped], k, T=tf.bool, N=2)

    def this_step(self, reduced: list) -> None:
        """Step t: the pending step applied first (the forward's reads wait),
        then this step's gradient and scalars kept in its place, and the
        update ops as written replaced by that keeping."""
        ctx, d, tg = self.ctx, self.d, self.ctx.tg
        forward = tg.ir.ancestors({r.node for r in tg.gradient_tensors})
        for k in range(self.n):
            done = self._apply(k, "step", reduced[k])
            at = f"{self._scope(k)}/step"
            pend = self.pending[k]
            after = ["^" + done]
            keep = [self._assign(f"{at}/keep", pend["gradient"][0],
                                 ctx.replica_tensor(k, self.grad.values), self.dtype, k, after),
                    self._assign(f"{at}/valid", pend["valid"][0], self._true(k), tf.bool, k,
                                 after)]
            scalars = [self._keep_scalar(k, at, i, ref, after)
                       for i, ref in enumerate(d.frontier)]
            for w in d.writers:           # the update as written: only the keeping now
                name = ctx.replica_name(k, w)
                old = self.ir.node(name)
                self.changed[name] = emit.node_def(
                    name, "NoOp", [i for i in old.input if i.startswith("^")] +
                    ["^" + x for x in keep] +
                    ["^" + scalars[d.frontier.index(r)] for r in d.needs[w]], old.device)
            for s in self.state:          # the forward reads the updated value
                for r in tg.readers.get(s, ()):
                    if r in forward and r not in d.ops:
                        self._copy(ctx.replica_name(k, r)).input.append("^" + done)

    def flush(self, k, gradient) -> str:
        done = self._apply(k, "flush", gradient)
        return self._clear(k, "flush/clear", ["^" + done])

    def finish(self) -> None:
        self._clear_on_writes(self.clears)

    def _true(self, k) -> str:
        name = f"{self._scope(k)}/true"
        if not any(a.name == name for a in self.added):
            self.added.append(emit.const(name, True, tf.bool, self.ctx.plan.devices[k]))
        return name

    def _clear(self, k, name, controls) -> str:
        """No step pending (after `controls`): the flag off, the kept values
        zeros (the next step's all-reduce reads the gradient anyway)."""
        at, device = f"{self._scope(k)}/{name}", self.ctx.plan.devices[k]
        ends = []
        for key, (h, dtype) in self.pending[k].items():
            shape = list(self.ctx.tg.variables[self.d.var].shape) if key == "gradient" else []
            self.added.append(emit.const(f"{at}/{key}/zeros",
                                         np.zeros(shape, dtype.as_numpy_dtype), dtype, device))
            ends.append("^" + self._assign(f"{at}/{key}", h, f"{at}/{key}/zeros", dtype, k,
                                           controls))
        return self._node(at, "NoOp", ends, k)
