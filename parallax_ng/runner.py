"""Runner: drives the transformed graph with the user's own fetches and feeds.

Requires: a transformed GraphIR and the PassContext that made it.
Guarantees: `run(fetches, feed_dict)` takes tensors, ops, variables or names
of the user's single-device graph (any nesting of lists, tuples, dicts) and
returns what one device would return for the global batch:
- an op runs in every replica (shared ops once);
- a tensor that is equal on all replicas (variables, global step, aggregated
  gradients) comes from replica 0;
- a tensor computed from a replica's own data is combined: scalars by mean,
  tensors with a batch dimension by concatenation along axis 0, strings and
  booleans from replica 0; `config.fetch_reduction` overrides per tensor
  (mean, sum, concat, first);
- `run(..., per_replica=True)` returns a list with every replica's value instead.
Feeds of placeholders with an unknown leading dimension are split evenly
across replicas (the global batch must divide by the replica count), and so
is a feed of N times a fixed leading dimension (the global batch of a
tensor built per replica, e.g. a fetched RNN state fed back); other feeds go
to every replica unchanged (with a warning, once, for a placeholder on the
gradients' path fed exactly its fixed batch).
"""
from __future__ import annotations

import difflib
import functools
import itertools
import warnings
from functools import cached_property

import numpy as np
import tensorflow as tf

from . import compat
from .errors import FetchError
from .ir import format_input, parse_input, parse_tensor
from .passes import REPLICA_PREFIX
from .queues import READ_PREFIXES
from .results import Barrier
from .stages import Stages


class Runner:
    def __init__(self, ir, ctx, config, session_config, records=(), server=None,
                 timeout: bool = False):
        self.ctx, self.plan, self.config = ctx, ctx.plan, config
        self.pass_records = list(records)
        self.server = server     # this worker's gRPC server in cluster mode
        self.graph = tf.Graph()
        with self.graph.as_default():
            tf.graph_util.import_graph_def(ir.graph_def, name="")
        self._checkpoints = None
        if config.checkpoint.dir:
            from .checkpoint import Checkpointer
            self._checkpoints = Checkpointer(self.graph, ctx, config.checkpoint.dir)
        self.session = tf.compat.v1.Session(
            server.target if server is not None else "", graph=self.graph,
            config=session_config)
        self._kinds: dict[tuple, tuple[bool, bool]] = {}
        self._sparsity_measured, self._probed = False, []
        self._restored = False
        self._steps = 0
        self._step_read = None
        self._user_graph = ctx.tg.graph
        self._late: dict[str, list[str]] = {}   # user op made after get_runner -> copies
        self._late_variant: set[str] = set()
        self._warned: set[str] = set()        # fed tensors already warned about
        self._imports = itertools.count()
        self._queues = None      # threads filling every replica's input queues
        if ctx.tg.queue_runners:
            from .queues import QueueThreads
            self._queues = QueueThreads(
                self.graph, ctx.tg.queue_runners,
                [ctx.replica_name(k, "").rstrip("/") for k in range(self.plan.num_replicas)])
        self._options = None     # in a job: every run gives up after the timeout
        if server is not None or timeout:
            self._options = tf.compat.v1.RunOptions(
                timeout_in_ms=int(self.plan.timeout_seconds * 1000))

    # -- public API -----------------------------------------------------------
    def run(self, fetches, feed_dict=None, options=None, run_metadata=None,
            per_replica: bool = False):
        leaves = tf.nest.flatten(fetches)
        plans = [self._fetch_plan(leaf, per_replica) for leaf in leaves]
        names = []
        for p in plans:
            names.extend(p["names"])
        feeds = self._feeds(feed_dict or {})
        fetched = tuple(p["user"] for p in plans)
        probe = self._sparsity_probe(fetched)
        stages = self.ctx.result(Stages)
        run = self.session.run if stages is None else functools.partial(
            stages.run, self.session, self.graph)
        if self._queues is not None and self._kind(fetched)[2]:
            self._queues.start(self.session)
        try:
            values = run(names + probe, feeds, options=options or self._options,
                         run_metadata=run_metadata)
        except (tf.errors.OutOfRangeError, tf.errors.CancelledError):
            if self._queues is not None:
                self._queues.raise_failure()   # a queue runner's error closed its queue
            raise
        if probe:
            self._record_sparsity(values[len(names):])
            values = values[:len(names)]
        self._after_run(fetched)
        out, i = [], 0
        for p in plans:
            got = values[i:i + len(p["names"])]
            i += len(p["names"])
            out.append(_combine(got, p))
        return tf.nest.pack_sequence_as(fetches, out)

    def save(self, saver, path: str) -> str:
        """Write replica 0's variables with the user's tf.compat.v1.train.Saver.

        The checkpoint has the single-device names, so a one-device script
        restores it unchanged.
        """
        d = saver.saver_def
        return self.run(d.save_tensor_name, {d.filename_tensor_name: path})

    def restore(self, saver, path: str) -> None:
        """Restore every replica's copy (and the shared variables) from `path`."""
        d = saver.saver_def
        self.run(d.restore_op_name, {d.filename_tensor_name: path})
        self._barrier()

    def close(self) -> None:
        if self._queues is not None:
            self._queues.stop()
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- fetches --------------------------------------------------------------
    def _fetch_plan(self, leaf, per_replica: bool) -> dict:
        name = self._user_name(leaf)
        ctx, n = self.ctx, self.plan.num_replicas
        if ":" not in name:            # an op: run it everywhere it exists
            targets = list(dict.fromkeys(self._copy_name(k, name) for k in range(n)))
            return {"names": [self.graph.get_operation_by_name(t) for t in targets],
                    "how": "none", "user": name}
        ref = parse_tensor(name)
        user_tensor = self._user_graph.get_tensor_by_name(name)
        if per_replica:
            how = "list"
        elif ref.node not in ctx.variant and ref.node not in self._late_variant:
            return {"names": [name], "how": "first", "user": ref.node}
        else:
            how = self.config.fetch_reduction.get(name) or _default_reduction(user_tensor)
        copies = [f"{self._copy_name(k, ref.node)}:{ref.index}" for k in range(n)]
        names = list(dict.fromkeys(copies))
        # a node that exists once (a shared variable) is every replica's value
        return {"names": names, "how": how, "user": ref.node,
                "replicas": [names.index(c) for c in copies]}

    # -- measured sparsity ----------------------------------------------------
    def _sparsity_probe(self, fetched: tuple) -> list[str]:
        """Replica 0's gradient indices, fetched along with the first training run."""
        if self._sparsity_measured or not self._kind(fetched)[1]:
            return []
        self._sparsity_measured = True
        grads = self.ctx.tg.gradients
        self._probed = [v for v, vp in sorted(self.plan.variables.items()) if vp.info.sparse]
        return [str(grads[v].indices) for v in self._probed]

    def _record_sparsity(self, indices: list) -> None:
        """Replace the plan's estimated alpha by rows touched / rows, as measured."""
        from dataclasses import replace

        from .analysis import with_measured_alpha
        measured = {}
        for var, idx in zip(self._probed, indices):
            rows = self.ctx.tg.variables[var].shape[0]
            if rows:
                measured[var] = len(np.unique(idx)) / rows
        info = with_measured_alpha({k: vp.info for k, vp in self.plan.variables.items()},
                                   measured)
        self.plan = replace(self.plan, variables={
            k: replace(vp, info=info[k]) for k, vp in self.plan.variables.items()})

    # -- checkpoints ----------------------------------------------------------
    def _after_run(self, fetched: tuple) -> None:
        """Restore after the first run that initialized variables; meet the
        other workers after initialisation and after each training step
        (multi-worker jobs with parameter servers); save every
        `checkpoint.every_steps` training steps (the global step if the graph
        has one, else runs that trained)."""
        initialized, trained, _ = self._kind(fetched)
        if initialized and not self._restored and self._checkpoints is not None:
            self._restored = True
            latest = self._checkpoints.latest()
            if latest:
                self._checkpoints.restore(self.session, latest)
        if initialized or trained:
            self._barrier()
        if trained and self._checkpoints is not None:
            self._steps += 1
            step = self._global_step()
            step = self._steps if step is None else step
            if step % self.config.checkpoint.every_steps == 0:
                self._checkpoints.save(self.session, step)

    def _barrier(self) -> None:
        """Chief: let the other workers go on (its writes are done); others:
        wait for that. A no-op without parameter servers across workers."""
        barrier = self.ctx.result(Barrier)
        if barrier is not None:
            op = self.graph.get_operation_by_name(barrier.op(self.plan.worker))
            self.session.run(op, options=self._options)

    def _kind(self, fetched: tuple) -> tuple[bool, bool, bool]:
        """(initializes variables, trains, reads an input queue) for a run of
        the user ops `fetched`."""
        if fetched not in self._kinds:
            tg = self.ctx.tg
            known = [f for f in fetched if f in tg.ir]
            late = [f for f in fetched if f in self._late]
            ancestors = tg.ir.ancestors(known)
            for name in late:   # ops made after get_runner: look at what they reach
                op = self._user_graph.get_operation_by_name(name)
                ancestors |= tg.ir.ancestors(
                    [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs])
            inits = {v.initializer for v in tg.variables.values() if v.initializer}
            reads_queue = any(tg.ir.node(a).op.startswith(READ_PREFIXES) for a in ancestors)
            self._kinds[fetched] = (bool(ancestors & inits),
                                    bool(ancestors & self._training_writers), reads_queue)
        return self._kinds[fetched]

    @cached_property
    def _training_writers(self) -> frozenset[str]:
        """Writers of trained variables that the gradients feed (not initializers
        or restores)."""
        tg = self.ctx.tg
        after_grads = tg.ir.descendants({g.values.node for g in tg.gradients.values()})
        return frozenset(w for v in tg.gradients for s in tg.owned(v)
                         for w in tg.writers.get(s, ()) if w in after_grads)

    def _global_step(self):
        tg = self.ctx.tg
        step = tf.compat.v1.train.get_global_step(self._user_graph)
        if step is None or step.op.name not in tg.variables:
            return None
        if self._step_read is None:
            from .checkpoint import read_value
            with self.graph.as_default():
                self._step_read = read_value(self.graph, tg.variables[step.op.name],
                                             self.plan.placement[step.op.name])
        return int(self.session.run(self._step_read))

    def _copy_name(self, k: int, node: str) -> str:
        """Replica k's copy of user node `node` in the runner's graph."""
        if node in self._late:
            return self._late[node][k]
        return self.ctx.replica_name(k, node)

    def _user_name(self, leaf) -> str:
        if isinstance(leaf, tf.Variable):
            element = getattr(leaf, "_graph_element", None)
            if element is None:   # a reference variable's value is its own output
                element = leaf.op.name + (":0" if leaf.op.type == "VariableV2"
                                          else "/Read/ReadVariableOp:0")
            leaf = element
        if isinstance(leaf, (tf.Tensor, tf.Operation)):
            if leaf.graph is not self._user_graph:
                raise FetchError(f"{leaf.name!r} belongs to another graph than the one "
                                 "given to get_runner")
            name = leaf.name
        elif isinstance(leaf, str):
            name = leaf
        else:
            raise FetchError(f"cannot fetch or feed a {type(leaf).__name__}; use a tensor, an op, "
                             "a variable or a name from the training graph")
        node = name.split(":")[0]
        if node not in self.ctx.tg.ir and node not in self._late:
            if not self._adopt(node):
                close = [self._fetchable(c) for c in
                         difflib.get_close_matches(node, self.ctx.tg.ir.names(), n=3)]
                raise FetchError(f"{name!r} is not in the training graph"
                                 + (f"; did you mean {close}?" if close else ""))
        if ":" in name:
            try:
                self._user_graph.get_tensor_by_name(name)
            except (KeyError, ValueError) as e:
                raise FetchError(f"{name!r} is not a tensor of the training graph: {e}") from None
        return name

    def _fetchable(self, node: str) -> str:
        """The name to fetch for a suggestion: an op's first output (a value),
        or the op itself when it has none (e.g. a training op)."""
        op = self._user_graph.get_operation_by_name(node)
        return op.outputs[0].name if op.outputs else node

    def _adopt(self, node: str) -> bool:
        """Copy user ops made after get_runner (e.g. a later
        global_variables_initializer()) into every replica; False if `node`
        is not in the user's graph at all."""
        try:
            op = self._user_graph.get_operation_by_name(node)
        except KeyError:
            return False
        known = self.ctx.tg.ir
        new, todo = {}, [op]
        while todo:
            o = todo.pop()
            if o.name in new or o.name in known or o.name in self._late:
                continue
            if o.type in ("VarHandleOp", "VariableV2"):
                raise FetchError(f"variable {o.name!r} was created after get_runner; "
                                 "create every variable before calling get_runner")
            new[o.name] = o
            todo.extend(t.op for t in o.inputs)
            todo.extend(o.control_inputs)
        order = [o for o in self._user_graph.get_operations() if o.name in new]
        for o in order:
            if any(t.op.name in self.ctx.variant or t.op.name in self._late_variant
                   for t in o.inputs):
                self._late_variant.add(o.name)
        for k, device in enumerate(self.plan.devices):
            scope = f"parallax/late_{next(self._imports)}"
            gd, input_map, controls = tf.compat.v1.GraphDef(), {}, {}
            for o in order:
                nd = gd.node.add()
                nd.CopyFrom(o.node_def)
                nd.name = _late_name(k, o.name)
                nd.device = device
                del nd.input[:]
                for text in o.node_def.input:
                    src, idx, control = parse_input(text)
                    if src in new:
                        nd.input.append(format_input(_late_name(k, src), idx))
                    elif control:
                        controls.setdefault(nd.name, []).append(self._copy_name(k, src))
                    else:
                        there = self._copy_name(k, src)
                        input_map[f"{src}:{idx}"] = self.graph.get_tensor_by_name(f"{there}:{idx}")
                        nd.input.append(f"{src}:{idx}")
            with self.graph.as_default():
                tf.graph_util.import_graph_def(gd, input_map=input_map, name=scope)
            for name, deps in controls.items():
                compat.add_control_inputs(self.graph.get_operation_by_name(f"{scope}/{name}"),
                                          [self.graph.get_operation_by_name(d) for d in deps])
            for o in order:
                self._late.setdefault(o.name, []).append(f"{scope}/{_late_name(k, o.name)}")
        return True

    # -- feeds ----------------------------------------------------------------
    def _feeds(self, feed_dict) -> dict:
        out = {}
        n = self.plan.num_replicas
        for key, value in feed_dict.items():
            name = self._user_name(key)
            if ":" not in name:
                name += ":0"
            ref = parse_tensor(name)
            user_tensor = self._user_graph.get_tensor_by_name(name)
            shape = user_tensor.shape
            copies = [f"{self._copy_name(k, ref.node)}:{ref.index}" for k in range(n)]
            rows = compat.dim(shape, 0) if shape.rank else 0
            if n > 1 and len(set(copies)) == n and rows != 0:
                value = np.asarray(value)
                if rows is None and value.shape[0] % n:
                    raise FetchError(
                        f"feed {name!r} has {value.shape[0]} rows, which do not split "
                        f"evenly over {n} replicas; feed a multiple of {n}")
                if rows is None or value.shape[0] == n * rows:
                    for c, part in zip(copies, np.split(value, n)):
                        out[c] = part
                    continue
                if value.shape[0] == rows:
                    self._warn_whole_feed(name, user_tensor, rows)
            for c in dict.fromkeys(copies):
                out[c] = value
        return out

    def _warn_whole_feed(self, name: str, tensor: tf.Tensor, rows: int) -> None:
        """Once per placeholder: a fixed batch dimension fed whole turns data
        parallelism off for it (every replica trains on the same rows)."""
        if name in self._warned or tensor.op.type != "Placeholder":
            return
        self._warned.add(name)
        if tensor.op.name not in self._feeds_gradients:
            return
        n = self.plan.num_replicas
        warnings.warn(
            f"placeholder {name!r} has a fixed batch dimension of {rows}, and a feed of "
            f"{rows} rows goes whole to each of the {n} replicas, which then train on the "
            f"same rows. Build it with shape [None, ...] to split feeds over the "
            f"replicas, or feed {n * rows} rows ({rows} per replica)", stacklevel=4)

    @cached_property
    def _feeds_gradients(self) -> set[str]:
        tg = self.ctx.tg
        return tg.ir.ancestors({r.node for r in tg.gradient_tensors}, data_only=True)


def _late_name(k: int, name: str) -> str:
    return name if k == 0 else REPLICA_PREFIX.format(k) + name


def _default_reduction(t: tf.Tensor) -> str:
    if not (t.dtype.is_floating or t.dtype.is_integer or t.dtype.is_complex):
        return "first"
    if t.shape.rank == 0:
        return "mean"
    return "concat"


def _combine(values: list, p: dict):
    how = p["how"]
    if how == "none":
        return None
    if how == "first":
        return values[0]
    if how == "list":
        return [values[i] for i in p["replicas"]]
    if how == "mean":
        return np.mean(np.stack(values), axis=0).astype(np.asarray(values[0]).dtype)
    if how == "sum":
        return np.sum(np.stack(values), axis=0)
    return np.concatenate([np.atleast_1d(v) for v in values], axis=0)
