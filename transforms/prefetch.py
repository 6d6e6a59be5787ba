"""Prefetch: a table's gradient rows the next batch reads go first, the
rest while the next step runs (EmbRace 4.2.2, vertical scheduling).

Requires: a table the plan cuts by columns (`alltoall`) with `prefetch`,
whose update math parallax_ng/planning/deferral.py accepted; runs after `columns`
(the lookup's exchange and the replicas' parts exist).
Guarantees, on every replica k, for such a table:
- step t runs the table's update math as written, with no gradient rows
  (rows without a gradient get what they would: nothing, or Adam's decay),
  after keeping the rows step t's batch touched (every replica's ids) as
  they were, with the replica's gradient rows (its distinct ids, duplicates
  summed) and the scalars the math reads from the step (learning rate,
  Adam's bias corrections, a moving average's decay): the pending step;
- step t+1, once its lookup has gathered every replica's ids, splits the
  pending rows into those its batch reads (prior) and the rest (scheduled);
  the prior rows' gradients are exchanged (AlltoAll, each replica its
  columns) and the update math, cloned onto the kept rows with step t's
  scalars, applied to them before the lookup reads the table; the
  scheduled rows the same way after the lookup's exchange, while the
  model runs, and before step t+1's own update;
- `Deferred.flush` applies a pending step in full (the runner runs it before
  anything but a training step reads the table: a fetch, a checkpoint);
  `Deferred.clear` forgets it, and runs with every write of the table that
  is not the update (an initializer, a restore).
The result equals the update applied at once: each row's math runs once per
step, in step order, with its own step's scalars.
New nodes live under `parallax/prefetch/<variable>/replica_<k>/`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from parallax_ng.errors import GraphError
from parallax_ng.graph import emit
from parallax_ng.graph.ir import GraphIR, parse_input
from parallax_ng.pipeline.results import CoalescedRows, Deferred, ExchangedLookups
from parallax_ng.planning import deferral
from transforms.deferred_updates import Nodes

PARTS = ("prior", "scheduled")
ROW_KEYS = ("rows", "every", "ids", "values")   # pending values with a row per id


@dataclass(frozen=True)
class PrefetchPass:
    name: str = "prefetch"
    requires: tuple = ("columns",)
    after: tuple = ()

    def run(self, ir: GraphIR, ctx):
        changed, added, flush, clear = {}, [], [], []
        tables = sorted(v for v, vp in ctx.plan.variables.items() if vp.prefetch)
        for var in tables:
            Table(ir, ctx, ctx.facts.deferral(var), changed, added).build(flush, clear)
        ctx.publish(Deferred(tuple(flush), tuple(clear)))
        return ir.replace(changed, added), {"tables": len(tables)}


class Table(Nodes):
    """The rewrite of one table on every local replica."""

    def __init__(self, ir, ctx, d: deferral.Deferral, changed: dict, added: list):
        super().__init__(ir, ctx, d, changed, added)
        self.part = ctx.plan.placement[d.var]
        self.itype = tf.as_dtype(ctx.tg.ir.node(d.lookup).attr["Tindices"].type)

    # -- the rewrite ------------------------------------------------------------
    def build(self, flush: list, clear: list) -> None:
        me0, n = self.ctx.plan.replica_offset, self.n
        self.pending = [self._pending(k, me0 + k) for k in range(n)]
        now = [self._lookup_ids(k) for k in range(n)]
        parts = [self._split(k, now[k][0], now[k][1]) for k in range(n)]
        applied = [[] for _ in range(n)]
        for part in PARTS:
            values = [parts[k][part]["values"] for k in range(n)]
            if part == "scheduled":      # after the lookup's exchange: the model waits less
                values = [self._node(f"{self._scope(k)}/scheduled/after_lookup", "Identity",
                                     [values[k], "^" + parse_input(now[k][2])[0]], k,
                                     T=self.dtype)
                          for k in range(n)]
            got = self._exchange(part, values, [p[part] for p in parts])
            for k in range(n):
                applied[k].append(self._apply(k, part, parts[k][part], got[k]))
        mine = []
        for k in range(n):
            self._this_step(k, applied[k], now[k])
            mine.append(self._clear(k, "clear", []))
        # a pending step applied in full, then forgotten
        whole = [self._whole(k) for k in range(n)]
        got = self._exchange("flush", [w["values"] for w in whole], whole)
        for k in range(n):
            done = self._apply(k, "flush", whole[k], got[k])
            flush.append(self._clear(k, "flush/clear", ["^" + done], after_read=True))
        self._clear_on_writes(mine)
        clear.extend(mine)

    def _scope(self, k):
        return f"parallax/prefetch/{self.d.var}/replica_{k}"

    def _pending(self, k, me):
        """Replica k's variables of the pending step: the rows kept, every
        replica's sizes and ids, its own gradient rows, the kept rows of the
        table and each slot, the scalars."""
        at, tg = f"{self._scope(k)}/pending", self.ctx.tg
        width = self.part.shards[me].size
        out = {"rows": (self._variable(f"{at}/rows", self.itype, [None], k), self.itype),
               "sizes": (self._variable(f"{at}/sizes", tf.int32, [None], k), tf.int32),
               "every": (self._variable(f"{at}/every", self.itype, [None], k), self.itype),
               "ids": (self._variable(f"{at}/ids", self.itype, [None], k), self.itype),
               "values": (self._variable(f"{at}/values", self.dtype, [None, self.part.width],
                                         k), self.dtype)}
        for i, s in enumerate(self.state):
            out[f"saved_{i}"] = (self._variable(f"{at}/saved_{i}", self.dtype, [None, width],
                                                k), self.dtype)
        for i, ref in enumerate(self.d.frontier):
            dtype = tg.tensor(ref).dtype.base_dtype
            out[f"scalar_{i}"] = (self._variable(f"{at}/scalar_{i}", dtype, [], k), dtype)
        return out

    def _lookup_ids(self, k):
        """(sizes, padded ids) the lookup gathered this step, its rows, and
        the gather of the replica's columns (aggregate built the exchange)."""
        made = self.ctx.result(ExchangedLookups)
        if made is None or self.d.lookup not in made.gathered:
            raise GraphError(f"prefetch needs the exchange of {self.d.lookup!r} built with "
                             f"{self.d.var!r}'s gradient")
        sizes, every = made.gathered[self.d.lookup][k]
        rows = made.rows[self.d.lookup][k]
        return sizes, every, rows, made.reads[self.d.lookup][k]

    def _whole(self, k):
        """The pending step as one part: all its rows."""
        part = {key: self._shared_read(k, key) for key in ("rows", "sizes", "every", "ids",
                                                            "values")}
        part["kept"] = self._traced(lambda r: tf.range(tf.size(r, out_type=tf.int32)),
                                    [(part["rows"], self.itype, [None])],
                                    f"{self._scope(k)}/flush/kept", k)[0]
        return part

    def _split(self, k, sizes, every):
        """The pending rows this step's ids read (prior) and the rest
        (scheduled): for each, the kept rows and their places among the
        kept, every replica's sizes and padded ids, this replica's ids and
        gradient rows."""
        n = self.ctx.plan.group_size
        reads = {key: self._shared_read(k, key)
                 for key in ("rows", "sizes", "every", "ids", "values")}
        outs = self._traced(lambda *t: _split(n, *t), [
            (reads["rows"], self.itype, [None]), (reads["sizes"], tf.int32, [None]),
            (reads["every"], self.itype, [None]), (reads["ids"], self.itype, [None]),
            (reads["values"], self.dtype, [None, self.part.width]),
            (sizes, tf.int32, [None]), (every, self.itype, [None])],
            f"{self._scope(k)}/split", k)
        keys = ("rows", "kept", "sizes", "every", "ids", "values")
        return {part: dict(zip(keys, outs[6 * p:6 * p + 6])) for p, part in enumerate(PARTS)}

    def _exchange(self, name, values, parts):
        """Every replica's rows of a part, each replica its columns of them."""
        plan = self.ctx.plan
        made, v, i = self.ctx.comm.columns_gradient(
            f"parallax/prefetch/{self.d.var}/{name}/exchange", values,
            [p["ids"] for p in parts], self.part, self.dtype, self.itype, plan.average_sparse,
            [(p["sizes"], p["every"]) for p in parts])
        self.added.extend(made)
        return list(zip(v, i))

    def _apply(self, k, name, part, got) -> str:
        """The update math cloned onto the rows of `part` (kept as they were
        before their step), with their gradient `got` and their step's
        scalars; written back. Returns the op that ends the write-back."""
        ctx, d, tg = self.ctx, self.d, self.ctx.tg
        at = f"{self._scope(k)}/{name}"
        values, ids = got
        place_type = tg.tensor(self.grad.indices).dtype
        pos = self._traced(lambda r, i: tf.cast(_places(r, i), place_type), [
            (part["rows"], self.itype, [None]), (ids, self.itype, [None])],
            f"{at}/places", k)[0]
        me = ctx.plan.replica_offset + k
        width = self.part.shards[me].size
        scratch, inits = {}, []
        for i, s in enumerate(self.state):
            h = self._variable(f"{at}/rows_{i}", self.dtype, [None, width], k)
            saved = self._shared_read(k, f"saved_{i}")
            kept = self._gather(f"{at}/rows_{i}/kept", saved, part["kept"], k)
            inits.append(self._assign(f"{at}/rows_{i}/init", h, kept, self.dtype, k))
            scratch[s] = h
        state = {s: scratch[s] for s in self.state}

        def inputs(ref):
            if ref == self.grad.values:
                return values
            if ref == self.grad.indices:
                return pos
            return state.get(tg.variable_of_handle(ref))

        clone = self._clone(k, at, inputs, ["^" + i for i in inits])
        last = ["^" + clone[w] for w in d.writers]
        ends = []
        for i, s in enumerate(self.state):
            value = self._read(scratch[s], self.dtype, k, last)
            ends.append("^" + self._node(
                f"{at}/rows_{i}/write_back", "ResourceScatterUpdate",
                [ctx.replica_name(k, s), part["rows"], value], k, dtype=self.dtype,
                Tindices=self.itype))
        return self._node(f"{at}/written", "NoOp", ends, k)

    def _gather(self, name, params, indices, k) -> str:
        axis = self._node(f"{name}/axis", "Const", [], k, dtype=tf.int32,
                          value=tf.compat.v1.AttrValue(tensor=tf.make_tensor_proto(0)))
        return self._node(name, "GatherV2", [params, indices, axis], k, Tparams=self.dtype,
                          Tindices=tf.int32, Taxis=tf.int32, batch_dims=0)

    def _this_step(self, k, applied: list, now) -> None:
        """Step t's side: the update math with no gradient rows, after the
        rows its batch touched are kept; the pending step replaced (after
        the last one was applied)."""
        ctx, d, tg = self.ctx, self.d, self.ctx.tg
        at, n = f"{self._scope(k)}/step", ctx.plan.group_size
        sizes, every = now[:2]
        after = ["^" + a for a in applied]
        rows = self._traced(lambda s, e: tf.unique(_valid(n, s, e), out_idx=tf.int32)[0],
                            [(sizes, tf.int32, [None]), (every, self.itype, [None])],
                            f"{at}/rows", k)[0]
        found = ctx.result(CoalescedRows)
        if found is None or d.var not in found.of:
            raise GraphError(f"prefetch needs {d.var!r}'s gradient rows coalesced by aggregate")
        values, ids = found.of[d.var][k]
        pend = self.pending[k]
        keeps = []
        for i, s in enumerate(self.state):
            got = self._node(f"{at}/keep_{i}/rows", "ResourceGather",
                             [ctx.replica_name(k, s), rows, *after], k, dtype=self.dtype,
                             Tindices=self.itype, batch_dims=0, validate_indices=True)
            keeps.append(self._assign(f"{at}/keep_{i}", pend[f"saved_{i}"][0], got,
                                      self.dtype, k, after))
        scalars = [self._keep_scalar(k, at, i, ref, after) for i, ref in enumerate(d.frontier)]
        news = [self._assign(f"{at}/{key}", pend[key][0], value, pend[key][1], k, after)
                for key, value in (("rows", rows), ("sizes", sizes), ("every", every),
                                   ("ids", ids), ("values", values))]
        me = ctx.plan.replica_offset + k
        device = ctx.plan.devices[k]
        no_values = emit.const(f"{at}/no_values", np.zeros(
            [0, self.part.shards[me].size], self.dtype.as_numpy_dtype), self.dtype, device)
        no_ids = emit.const(f"{at}/no_ids", np.zeros([0], self.itype.as_numpy_dtype),
                            self.itype, device)
        self.added += [no_values, no_ids]
        for op in d.ops:
            for pos, ref in enumerate(tg.ir.data_inputs(op)):
                if ref in (self.grad.values, self.grad.indices):
                    nd = self._copy(ctx.replica_name(k, op))
                    nd.input[pos] = no_values.name if ref == self.grad.values else no_ids.name
        for op in d.ops:     # reads too: a read of the table after the rows are back
            if op not in d.writers and not any(tg.variable_of_handle(r) in self.state
                                               for r in tg.ir.data_inputs(op)):
                continue
            nd = self._copy(ctx.replica_name(k, op))
            nd.input.extend(after + ["^" + x for x in keeps + news] +
                            ["^" + scalars[d.frontier.index(r)] for r in d.needs.get(op, ())])
        self._copy(now[3]).input.append("^" + applied[0])

    def _clear(self, k, name, controls, after_read=False) -> str:
        """Assign the empty pending step (after `controls`); the op that ends
        it. With `after_read`, the empty values are made from reads of the
        pending values (a run that reads them must not see the variables'
        shapes fixed by a constant assigned in it: grappler's constant
        folding takes them from that assign and folds the reads' sizes)."""
        at, device = f"{self._scope(k)}/{name}", self.ctx.plan.devices[k]
        me = self.ctx.plan.replica_offset + k
        shapes = {"rows": [0], "sizes": [self.ctx.plan.group_size], "every": [0], "ids": [0],
                  "values": [0, self.part.width]}
        ends = []
        for key, (h, dtype) in self.pending[k].items():
            shape = shapes.get(key, [0, self.part.shards[me].size] if key.startswith("saved")
                               else [])
            if after_read:
                empty = self._traced(
                    lambda x, rows=key in ROW_KEYS or key.startswith("saved"): tf.boolean_mask(
                        x, tf.zeros(tf.shape(x)[:1], tf.bool)) if rows else tf.zeros_like(x),
                    [(self._shared_read(k, key), dtype, [None] * len(shape))], f"{at}/{key}/empty",
                    k)[0]
            else:
                empty = f"{at}/{key}/empty"
                self.added.append(emit.const(empty, np.zeros(shape, dtype.as_numpy_dtype),
                                             dtype, device))
            ends.append("^" + self._assign(f"{at}/{key}", h, empty, dtype, k, controls))
        return self._node(at, "NoOp", ends, k)


def _valid(n, sizes, every):
    """The ids of padded per-replica `every` ([n * longest]) without padding."""
    longest = tf.size(every) // n
    return tf.boolean_mask(every, tf.reshape(tf.sequence_mask(sizes, longest), [-1]))


def _member(x, y):
    """Whether each element of `x` is in `y`."""
    _, out = tf.raw_ops.ListDiff(x=x, y=y, out_idx=tf.int32)
    hits = tf.scatter_nd(out[:, None], tf.ones_like(out), tf.shape(x, out_type=tf.int32))
    return tf.equal(hits, 0)


def _split(n, rows, sizes, every, ids, values, now_sizes, now_every):
    """For the pending rows `now_every` reads, then for the rest: (those
    rows, their places in `rows`, every replica's count and padded ids of
    them, this replica's ids and gradient rows of them), named
    `<prior|scheduled>_<rows|kept|sizes|every|ids|values>` (the benchmark
    counts the prior ids)."""
    now = _valid(n, now_sizes, now_every)
    longest = tf.size(every) // n
    keep = tf.reshape(tf.sequence_mask(sizes, longest), [-1])
    out = []
    for prior in (True, False):
        def pick(x):
            m = _member(x, now)
            return m if prior else tf.logical_not(m)
        on_rows = pick(rows)
        grid = tf.reshape(tf.logical_and(keep, pick(every)), tf.stack([n, longest]))
        counts = tf.reduce_sum(tf.cast(grid, tf.int32), 1)
        where = tf.where(grid)
        column = tf.cumsum(tf.cast(grid, tf.int64), axis=1, exclusive=True)
        packed = tf.scatter_nd(tf.stack([where[:, 0], tf.gather_nd(column, where)], 1),
                               tf.boolean_mask(tf.reshape(every, tf.stack([n, longest])), grid),
                               tf.cast(tf.stack([n, tf.maximum(tf.reduce_max(counts), 1)]),
                                       tf.int64))
        own = pick(ids)
        part = "prior" if prior else "scheduled"
        out += [tf.identity(t, name=f"{part}_{key}") for key, t in (
            ("rows", tf.boolean_mask(rows, on_rows)),
            ("kept", tf.cast(tf.reshape(tf.where(on_rows), [-1]), tf.int32)),
            ("sizes", counts), ("every", tf.reshape(packed, [-1])),
            ("ids", tf.boolean_mask(ids, own)), ("values", tf.boolean_mask(values, own)))]
    return out


def _places(rows, ids):
    """The place of each of `ids` in `rows` (distinct, holding all of them)."""
    _, where = tf.unique(tf.concat([rows, ids], 0), out_idx=tf.int32)
    return where[tf.size(rows):]
