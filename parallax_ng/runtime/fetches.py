"""Fetches and feeds: the user's names, mapped onto the step graph.

Requires: the runner's tf.Graph and the TrainingGraph it was made from
(for the replicas' map, the PassContext that made it).
Guarantees: `FetchMap.user_name(leaf)` is the user-graph name of a key (a
clear error, with suggestions, for a name that is not there); ops made
after get_runner are copied into the step graph when first named.
`fetch(leaf, per_replica)` gives a `Fetch` (what to run and how the values
combine, runtime/combining.py; `fetch_leaf` a SparseTensor too; a feedable
iterator's handle is every replica's, and a feed of it gives each its
own); `feeds(feed_dict)` maps a feed dict onto the step graph.
`ReplicaFetchMap`: the data-parallel graph's (layer-to-layer's: l2l/runner.py).
"""
from __future__ import annotations

import difflib
import sys
import warnings
from functools import cached_property

import numpy as np
import tensorflow as tf

from .. import compat
from ..errors import FetchError, UnevenFeed
from ..graph import accumulation, batch, forms, rules, variance
from ..graph.ir import parse_tensor
from ..graph.time_major import analysed, batch_major, twin
from ..pipeline.results import PerExampleState, ScaledInputs, WidenedMeans
from . import one_replica, summaries
from .batch_parts import sparse_feeds
from .combining import Fetch, ReplicaHandles, default_reduction, unread
from .copies import adopt, writes_apart


class FetchMap:
    """The user's fetch and feed keys as names of the user's graph; a step graph's map (the
    replicas' below, layer-to-layer's in parallax_ng/l2l/runner.py) says what to run for
    them (`fetch`), where feeds go (`feeds`) and copies ops made after get_runner (`_adopt`)."""

    def __init__(self, graph: tf.Graph, tg, config):
        self.graph, self.tg, self.config = graph, tg, config
        self.user_graph = tg.user_graph
        self.late: dict = {}          # user op made after get_runner -> its copies

    def fetch(self, leaf, per_replica: bool = False) -> Fetch:
        raise NotImplementedError

    def varies(self, node: str) -> bool:
        """Whether user node `node`'s value differs between the step's copies."""
        return True

    def fetch_leaf(self, leaf, per_replica: bool = False) -> Fetch:
        """`fetch`, and a tf.SparseTensor as its three tensors: equal on
        every replica, replica 0's; else the replicas' rows joined (a
        decoder's batch of sparse rows, as one device gives it); a
        tf.IndexedSlices (an embedding's gradient, printed to debug) as its
        values, indices and dense shape, each fetched as itself is."""
        if isinstance(leaf, tf.IndexedSlices):
            tensors = (leaf.values, leaf.indices) + \
                (() if leaf.dense_shape is None else (leaf.dense_shape,))
            parts = tuple(self.fetch(t, per_replica) for t in tensors)
            return Fetch(sum((p.names for p in parts), ()),
                         "slices list" if per_replica else "slices", parts[0].user, parts=parts)
        if not isinstance(leaf, tf.SparseTensor):
            return self.fetch(leaf, per_replica)
        parts = tuple(self.fetch(t, True) for t in (leaf.indices, leaf.values, leaf.dense_shape))
        how = "sparse list" if per_replica else \
            "sparse first" if not self.varies(leaf.values.op.name) else "sparse rows"
        return Fetch(sum((p.names for p in parts), ()), how, parts[1].user, parts=parts)

    def feeds(self, feed_dict) -> dict:
        raise NotImplementedError

    def _adopt(self, node: str) -> bool:
        """Copy user op `node` (made after get_runner) in; False if not a user op."""
        raise NotImplementedError

    def user_name(self, leaf) -> str:
        """The name in the user's graph of a fetch or feed key; copies ops made
        after get_runner into the step graph."""
        if isinstance(leaf, tf.Variable):
            element = getattr(leaf, "_graph_element", None)
            if element is None:   # a reference variable's value is its own output
                element = leaf.op.name + (":0" if leaf.op.type == "VariableV2"
                                          else "/Read/ReadVariableOp:0")
            leaf = element
        if isinstance(leaf, (tf.Tensor, tf.Operation)):
            if leaf.graph is not self.user_graph:
                raise FetchError(f"{leaf.name!r} belongs to another graph than the one "
                                 "given to get_runner")
            name = leaf.name
        elif isinstance(leaf, str):
            name = leaf
        else:
            raise FetchError(f"cannot fetch or feed a {type(leaf).__name__}; use a tensor, an op, "
                             "a variable or a name from the training graph")
        node = name.split(":")[0]
        if node not in self.tg.ir and node not in self.late:
            if not self._adopt(node):
                close = [self._fetchable(c) for c in
                         difflib.get_close_matches(node, self.tg.ir.names(), n=3)]
                raise FetchError(f"{name!r} is not in the training graph"
                                 + (f"; did you mean {close}?" if close else ""))
        if ":" in name:
            try:
                self.user_graph.get_tensor_by_name(name)
            except (KeyError, ValueError) as e:
                raise FetchError(f"{name!r} is not a tensor of the training graph: {e}") from None
        return name

    def _fetchable(self, node: str) -> str:
        """A suggestion's name: an op's first output, or the op (a training op)."""
        op = self.user_graph.get_operation_by_name(node)
        return op.outputs[0].name if op.outputs else node

    def _new_ops(self, node: str) -> dict | None:
        """User op `node` and the ops it needs that the step graph lacks (made after
        get_runner), by name; None if `node` is not in the user's graph."""
        try:
            op = self.user_graph.get_operation_by_name(node)
        except KeyError:
            return None
        new, todo = {}, [op]
        while todo:
            o = todo.pop()
            if o.name in new or o.name in self.tg.ir or o.name in self.late:
                continue
            if o.type in ("VarHandleOp", "VariableV2"):
                raise FetchError(f"variable {o.name!r} was created after get_runner; "
                                 "create every variable before calling get_runner")
            new[o.name] = o
            todo.extend(t.op for t in o.inputs)
            todo.extend(o.control_inputs)
        return new


class ReplicaFetchMap(FetchMap):
    """Fetches and feeds of the data-parallel passes' graph: every replica's copy of a node."""

    def __init__(self, graph: tf.Graph, ctx, config):
        super().__init__(graph, ctx.tg, config)
        self.ctx, self.plan = ctx, ctx.plan
        self.late_variant: set[str] = set()
        self._warned: set[str] = set()          # fed tensors already warned about
        self._reductions: dict[str, str] = {}    # fetched tensor -> its default reduction
        self._parts: dict[str, tuple] = {}       # fetched tensor -> its summary's parts
        self._everywhere: dict[str, bool] = {}    # node -> every replica's copy runs
        self._aggregated: dict = {}     # dense gradient -> the copies of its aggregate

    # -- fetches --------------------------------------------------------------
    def fetch(self, leaf, per_replica: bool = False) -> Fetch:
        name = self.user_name(leaf)
        n = self.plan.num_replicas
        if ":" not in name:            # an op: run it everywhere it exists
            targets = dict.fromkeys(self.copy_name(k, name) for k in range(n))
            return Fetch(tuple(self.graph.get_operation_by_name(t) for t in targets),
                         "none", name)
        ref = parse_tensor(name)
        if per_replica:
            how = "list"
        elif (rows := self._per_example(ref)) is not None:
            how, axis = "concat", rows       # each replica's rows of per-example state
        elif self._accumulated(ref):
            how = "mean"    # each replica's sum of its gradients: their mean is one device's
        elif self.user_graph.get_operation_by_name(ref.node).type == "IteratorToStringHandle":
            how = "handles"     # each replica's iterator's (combining.ReplicaHandles)
        elif ref in self.tg.gradient_tensors:
            var = self._gradient_of[ref]
            if self.tg.gradients[var].indices is None:
                return Fetch(self._aggregates(ref), "first", ref.node)
            # a sparse gradient's rows: one device's are the replicas' in order, each
            # replica's a gradient of its own mean where the gradients are averaged
            how, axis = "concat" if ref == self.tg.gradients[var].indices or \
                not self.plan.average_sparse else "concat mean", 0
        elif not self.varies(ref.node):
            if not self._runs_everywhere(ref.node):
                return Fetch((f"{self.copy_name(0, ref.node)}:{ref.index}",), "first", ref.node)
            how = "first"      # equal on every replica: every copy runs
        else:
            how, axis = self._reduction(name)
            how = self.config.fetch_reduction.get(name) or how
        parts = self._summary_parts(name) if how == "first" else ()
        copies = [f"{self.copy_name(k, ref.node)}:{ref.index}" for k in range(n)]
        names = tuple(dict.fromkeys(copies))
        # a node that exists once (a shared variable) is every replica's value
        return Fetch(names, "summary" if parts else how, ref.node,
                     tuple(names.index(c) for c in copies),
                     axis if how.startswith("concat") or how == "shape" else 0, parts)

    def _summary_parts(self, name: str) -> tuple:
        """A TF1 summary's tags and how each combines (read once per tensor,
        not per step); () for any other tensor or one `fetch_reduction` names."""
        if name not in self._parts:
            user = self.user_graph.get_tensor_by_name(name)
            self._parts[name] = summaries.parts(user, self._how) if summaries.is_summary(
                user) and name not in self.config.fetch_reduction else ()
        return self._parts[name]

    def _how(self, t: tf.Tensor) -> str:
        """How the replicas' values of user tensor t combine, as a fetch of it."""
        return "first" if not self.varies(t.op.name) else \
            self.config.fetch_reduction.get(t.name) or self._reduction(t.name)[0]

    def varies(self, node: str) -> bool:
        return node in self.ctx.synced_variant or node in self.late_variant

    def _per_example(self, ref) -> int | None:
        """The axis of its examples' rows where `ref` is a variable the step
        writes with rows of its batch (transforms/state_sync.py), else None."""
        axes = self._example_axes
        if not axes or ref.node not in self.tg.ir:
            return None
        return axes.get(ref.node, axes.get(accumulation.read_variable(self.tg, ref)))

    @cached_property
    def _example_axes(self) -> dict:
        """{variable: axis} of PerExampleState, read once (fetch runs every run)."""
        state = self.ctx.result(PerExampleState)
        return dict(state.axes) if state else {}

    def _accumulated(self, ref) -> bool:
        """Whether `ref` is the value of a variable the script accumulates
        gradients in (graph/accumulation.py): replica-local, never synced."""
        if not self.tg.accumulators or ref.node not in self.tg.ir:
            return False
        return ref.node in self.tg.accumulators or \
            accumulation.read_variable(self.tg, ref) in self.tg.accumulators

    @cached_property
    def _gradient_of(self) -> dict:
        """{gradient tensor: its variable}, read once (fetch is on the run's path)."""
        return {r: v for v, g in self.tg.gradients.items() for r in (g.values, g.indices)
                if r is not None}

    def _aggregates(self, ref) -> tuple:
        """Replica 0's aggregate of dense gradient `ref`, and where it meets
        the other replicas (an all-reduce), theirs too: they run with it
        (replica 0's alone waited for the others' part until the timeout)."""
        if ref not in self._aggregated:
            first = self._aggregate(ref, 0)
            self._aggregated[ref] = (first,) if not one_replica.reaches(self.graph, [first]) \
                else tuple(dict.fromkeys(self._aggregate(ref, k)
                                         for k in range(self.plan.num_replicas)))
        return self._aggregated[ref]

    def _aggregate(self, ref, k: int) -> str:
        """The global batch's gradient that dense gradient `ref` becomes, as
        the update (or any other use) reads it in replica k: one device's."""
        ir, var = self.tg.ir, self._gradient_of[ref]
        for consumer, pos in sorted(ir.consumers.get(ref, ())):
            if rules.is_autodiff_use(ir.node(consumer)):
                continue
            try:
                op = self.graph.get_operation_by_name(self.copy_name(k, consumer))
            except KeyError:
                continue
            if op.type == ir.node(consumer).op and pos < len(op.inputs):
                return op.inputs[pos].name
        raise FetchError(f"the gradient {ref.node}:{ref.index} of {var!r} cannot be fetched: "
                         f"its {self.plan.variables[var].method} aggregate has no one value "
                         "(each replica holds its part); fetch a tensor computed from it, or "
                         "the replicas' own gradients with per_replica=True")

    def _runs_everywhere(self, node: str) -> bool:
        """Whether every replica's copy of an equal-on-every-replica node must
        run: it is computed from the replicas' own data (a metric's update,
        its total synced across the replicas: replica 0's would wait for the
        others in the sync, and their state would fall behind), it writes
        state each replica holds (an assign to a learning-rate variable:
        parallax_ng/runtime/copies.py), or its copy meets the others' (a
        norm of gradients accumulated in the script's variables, all-reduced
        where they are read: replica 0's alone waited until the timeout)."""
        if node not in self._everywhere:
            self._everywhere[node] = node in self.tg.ir and bool(
                self.tg.ir.ancestors({node}) & self.ctx.variant) or \
                writes_apart(self, node) or \
                one_replica.reaches(self.graph, [self.copy_name(0, node)])
        return self._everywhere[node]

    def _reduction(self, name: str) -> tuple[str, int]:
        if name not in self._reductions:         # read once per tensor, not per step
            widened, t = self.ctx.result(WidenedMeans), analysed(self.tg, name)
            scaled = self.ctx.result(ScaledInputs)    # one device's share each: summed
            how, axis, shown = default_reduction(
                t, self._sources, widened.divisions if widened else frozenset(),
                self.plan.average_dense and not (scaled and scaled.holds(name)), self._said_names)
            self._reductions[name] = how, axis
            if not shown and name not in self.config.fetch_reduction and not self._said(t):
                print(unread(name, t, how), file=sys.stderr, flush=True)
        return self._reductions[name]

    def _said(self, t: tf.Tensor) -> bool:
        """Whether `t` is (an identity of) a loss the graph differentiates (its form
        warned about already) or an output its program joins by rows."""
        while t.op.type in ("Identity", "Snapshot") and t.name not in self._said_names:
            t = t.op.inputs[0]
        return t.name in self._said_names

    @cached_property
    def _said_names(self) -> frozenset[str]:
        return frozenset([loss.name for loss in forms.autodiff_losses(self.user_graph)] +
                         self.user_graph.get_collection(forms.JOINED_ROWS))

    @cached_property
    def _sources(self) -> list[str]:
        """The data sources (`analysed`): every placeholder and iterator (a
        scalar scaled by a fed number has no form, and keeps the mean)."""
        return forms.sources(self.tg.graph if self.tg.time_major else self.user_graph)

    def copy_name(self, k: int, node: str) -> str:
        """Replica k's copy of user node `node` in the runner's graph."""
        if node in self.late:
            return self.late[node][k]
        return self.ctx.replica_name(k, node)

    def _adopt(self, node: str) -> bool:
        """Copy user ops made after get_runner (a later global_variables_initializer())
        into the step graph (parallax_ng/runtime/copies.py)."""
        new = self._new_ops(node)
        if new is None:
            return False
        made, variant = adopt(self, new)
        self.late.update(made)
        self.late_variant |= variant
        return True

    # -- feeds ----------------------------------------------------------------
    def feeds(self, feed_dict, alone: bool = False) -> dict:   # alone: replica 0's
        n = 1 if alone else self.plan.num_replicas
        feed_dict, out = sparse_feeds(self, dict(feed_dict or {}), n)
        unsure, batches = {}, set()       # split without the graph's word; a batch's rows
        for key, value in feed_dict.items():
            name = self.user_name(key)
            if ":" not in name:
                name += ":0"
            ref = parse_tensor(name)
            if axis := self.tg.time_major.get(ref.node):    # fed through its batch-major twin
                ref, value = parse_tensor(twin(ref.node) + ":0"), batch_major(value, axis)
            user_tensor = (self.tg.graph if axis else self.user_graph).get_tensor_by_name(
                f"{ref.node}:{ref.index}")
            shape = user_tensor.shape
            copies = [f"{self.copy_name(k, ref.node)}:{ref.index}" for k in range(n)]
            rows = compat.dim(shape, 0) if shape.rank else 0
            if isinstance(value, ReplicaHandles) and len(set(copies)) == len(value.each) == n:
                out.update(zip(copies, value.each))     # each replica its own iterator
                continue
            if n > 1 and len(set(copies)) == n and rows != 0:
                value = np.asarray(value)
                kind = batch.BATCH if axis or rows is not None and \
                    ref.node not in self.config.batch_feeds else self._batch_kind(ref.node)
                if kind == batch.WHOLE:
                    for c in copies:
                        out[c] = value
                    continue
                if kind == batch.UNKNOWN:
                    unsure[ref.node] = (len(value), user_tensor.op.type)
                elif rows is None:
                    batches.add(len(value))
                if rows is None and len(value) % n:
                    raise UnevenFeed(
                        f"feed {name!r} has {len(value)} rows, which do not split "
                        f"evenly over {n} replicas; feed a multiple of {n}, or set "
                        f"config `batch_feeds: {{{ref.node}: false}}` if every replica "
                        "needs it whole")
                if rows is None or len(value) == n * rows:
                    for c, part in zip(copies, np.split(value, n)):
                        out[c] = part
                    continue
                if len(value) == rows:
                    self._warn_whole_feed(name, user_tensor, rows)
            for c in dict.fromkeys(copies):
                out[c] = value
        for node, (rows, op) in unsure.items():
            if op in PLACEHOLDERS or rows not in batches:    # a tensor fed beside a batch
                self._unsure(node, rows, op)       # of as many rows (an RNN's state) is one
        return out

    def _batch_kind(self, node: str) -> str:
        """Placeholder `node`'s kind (config `batch_feeds`, else graph/batch.py)."""
        if node in self.config.batch_feeds:
            return batch.BATCH if self.config.batch_feeds[node] else batch.WHOLE
        return self._kinds.get(node, (batch.UNKNOWN, ""))[0]

    def _unsure(self, node: str, rows: int, op: str) -> None:
        """Once per placeholder the graph does not show to be a batch: it is split as one (a
        `[None, ...]` feed almost always is; whole, a batch would count N times in state)."""
        if node in self._warned:
            return
        self._warned.add(node)
        what, why = ("placeholder", "it is not in the analysed graph") if op in PLACEHOLDERS \
            else (f"fed tensor ({op})", "only placeholders are read for batches")
        why = self._kinds.get(node, (0, why))[1]
        print(f"parallax_ng: {what} {node!r}: {why}; its feed ({rows} rows) is split "
              f"over the replicas as a batch. If every replica needs it whole, set config "
              f"`batch_feeds: {{{node}: false}}` (true: split, silently)",
              file=sys.stderr, flush=True)

    @cached_property
    def _kinds(self) -> dict:
        return variance.feed_kinds(self.ctx.tg)

    def _warn_whole_feed(self, name: str, tensor: tf.Tensor, rows: int) -> None:
        """Once per placeholder: a fixed batch dimension fed whole turns data
        parallelism off for it (every replica trains on the same rows)."""
        if name in self._warned or tensor.op.type != "Placeholder" or \
                tensor.op.name not in self._feeds_gradients:
            return
        self._warned.add(name)
        n, shape = self.plan.num_replicas, tensor.shape
        free = next((k for k in range(1, shape.rank) if compat.dim(shape, k) is None), None)
        warnings.warn(
            f"placeholder {name!r} has a fixed batch dimension of {rows}, and a feed of "
            f"{rows} rows goes whole to each of the {n} replicas, which then train on the "
            f"same rows. Build it with shape [None, ...] to split feeds over the replicas, "
            f"or feed {n * rows} rows ({rows} per replica)" + ("" if free is None else
            f". If its axis {free} is the batch (time-major data), set config "
            f"`batch_feeds: {{{tensor.op.name}: {free}}}`"),
            stacklevel=5)

    @cached_property
    def _feeds_gradients(self) -> set[str]:
        return self.tg.ir.ancestors({r.node for r in self.tg.gradient_tensors}, data_only=True)


PLACEHOLDERS = ("Placeholder", "PlaceholderWithDefault")
