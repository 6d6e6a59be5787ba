"""The runner of layer-to-layer execution: the user's fetches on the L2L graph.

Requires: a TrainingGraph, the devices that are replicas, a Config whose
`l2l.layers` is set.
Guarantees: `run(fetches, feed_dict)` takes what the user's single-device
graph would (tensors, ops, variables, names, nested) and returns what one
device would for the global batch:
- the training op runs one L2L step (parallax_ng/l2l/builder.py);
- the loss is the mean of the micro-batches' losses over all replicas (the
  whole batch's mean loss);
- another tensor of the forward pass is taken from every replica's
  micro-batches: the mean of a scalar, batch-shaped values concatenated
  (`fetch_reduction` overrides: mean, sum, concat, first);
- variables, slots, the global step and every op outside the forward come
  from the host, where they live;
- a fed placeholder with an unknown leading dimension is split into
  replicas x micro-batches parts (its batch must divide evenly); other feeds
  are used whole.
`plan` says how the model was cut (printable). With `checkpoint.dir`, the
first run that initializes restores the newest checkpoint, and every
`checkpoint.every_steps` training steps are saved (class Checkpoints).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from .. import compat
from ..errors import ConfigError, FetchError
from ..graph.ir import parse_input
from ..resources import check_devices, session_config
from ..runtime import heartbeat
from ..runtime.checkpoint import ITERATOR_OPS, Checkpointer, assign_value, read_value
from ..runtime.fetches import Fetch, combine
from . import builder as l2l
from . import layers


@dataclass(frozen=True)
class L2LPlan:
    devices: tuple[str, ...]
    host: str
    segments: tuple[tuple[str, int, int], ...]   # (name, weights, ops)
    micro_batches: int
    stash: str
    precision: str
    num_workers: int = 1
    worker: int = 0
    random: int = 0                 # random ops the recomputation draws again

    @property
    def num_replicas(self) -> int:
        return len(self.devices)

    @property
    def group_size(self) -> int:
        return len(self.devices) * self.num_workers

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def format(self) -> str:
        return str(self)

    def __str__(self) -> str:
        lines = [f"layer-to-layer: worker {self.worker} of {self.num_workers}, "
                 f"{len(self.devices)} replicas ({', '.join(self.devices)}), "
                 f"host {self.host}, {self.micro_batches} micro-batches, stash on "
                 f"{self.stash}, {self.precision}"
                 + (f", {self.random} random ops drawn again by the recomputation "
                    "(stateless)" if self.random else "")]
        for name, weights, ops in self.segments:
            lines.append(f"  {name:<16} {weights:4d} variables {ops:6d} ops")
        return "\n".join(lines)


def plan_of(layering, devices, host: str, cfg, job=(1, 0)) -> L2LPlan:
    """What `parallax-ng plan` prints for config l2l `cfg`."""
    return L2LPlan(tuple(devices), host, tuple(
        (s.name, len(s.weights) + len(s.handles), len(s.ops)) for s in layering.segments),
        cfg.micro_batches, cfg.stash, cfg.precision, *job, len(layering.random))


def l2l_runner(tg, job) -> "L2LRunner":
    """Layer-to-layer execution of `tg` for a build.Job: on this machine's
    devices, or as one worker of a job (its own host the EPS)."""
    config, info = job.config, job.cluster
    if config.communication.backend != "tf":
        raise ConfigError("config key 'l2l' keeps the model on the host of one process; "
                          "'communication.backend: horovod' does not apply to it")
    if info is None:
        devices = job.resources.hosts[0].devices
        check_devices(devices)
        return L2LRunner(tg, [l2l.device_string(kind, i) for kind, i in devices], config,
                         session_config(devices))
    if info.task_type != "worker" or info.ps:
        raise ConfigError("config key 'l2l': every worker's host is its parameter server; "
                          "list no 'ps' in the resources")
    check_devices(info.devices, f"worker {info.task} ({info.workers[info.task]})")
    server = info.start_server()
    runner = L2LRunner(tg, info.device_strings(), config, info.session_config(),
                       target=server.target, host=info.host,
                       job=(len(info.workers), info.task))
    runner.server = server
    return runner


def l2l_plan(tg, job) -> L2LPlan:
    """How layer-to-layer execution cuts `tg` for a build.Job (nothing is built)."""
    info, cfg = job.cluster, job.config.l2l
    if info is not None:
        return plan_of(layers.split(tg, cfg.layers, cfg.loss), info.device_strings(),
                       info.host, cfg, (len(info.workers), 0))
    devices = [l2l.device_string(kind, i) for kind, i in job.resources.hosts[0].devices]
    return plan_of(layers.split(tg, cfg.layers, cfg.loss), devices,
                   l2l.device_string("CPU", 0), cfg)


class L2LRunner:
    def __init__(self, tg, devices: list[str], config, session_config, target: str = "",
                 host: str | None = None, job: tuple[int, int] = (1, 0)):
        """devices: the replicas' device strings; `job`: (workers, this worker)."""
        cfg = config.l2l
        self.config, self.tg = config, tg
        self.layering = layers.split(tg, cfg.layers, cfg.loss)
        host = host or l2l.device_string("CPU", 0)
        self.built = l2l.build(tg, self.layering, cfg, list(devices), host, job,
                               average=(config.average_dense, config.average_sparse))
        self.graph = self.built.graph
        self.plan = plan_of(self.layering, devices, host, cfg, job)
        self._split = {s + ":0" for s in self.layering.sources} & {
            op.name + ":0" for op in tg.graph.get_operations() if op.type == "Placeholder"}
        self._parts = len(devices) * cfg.micro_batches
        # runs that initialize variables are followed, in a job, by worker 0's values
        self._initializes = tg.ir.descendants(
            {v.initializer for v in tg.variables.values() if v.initializer})
        writers = {w for var, ws in tg.writers.items() for w in ws} - {
            v.initializer for v in tg.variables.values()}
        self._trains = tg.ir.descendants(writers)
        self._checkpoints, self._restored, self._steps = None, False, 0
        self._forward_reads: dict[str, str | None] = {}
        self._late: dict[str, tf.Operation] = {}      # ops copied in after get_runner
        if config.checkpoint.dir:
            self._checkpoints = Checkpoints(self.graph, tg, config.checkpoint.dir, host, *job)
        self.session = tf.compat.v1.Session(target, graph=self.graph, config=session_config)
        self._timeout = tf.compat.v1.RunOptions(
            timeout_in_ms=int(config.communication.timeout_seconds * 1000))

    def run(self, fetches, feed_dict=None, options=None, run_metadata=None):
        leaves = tf.nest.flatten(fetches)
        wanted = [self._fetch(leaf) for leaf in leaves]
        names = [n for f in wanted for n in f.names]
        feeds = {self._feed_key(k): v for k, v in (feed_dict or {}).items()}
        for name, value in feeds.items():
            self._check_feed(name, value)
        if options is None:
            options = self._timeout
        with heartbeat.running():
            values = self.session.run(names, feeds, options=options, run_metadata=run_metadata)
        self._after_run({f.user for f in wanted})
        out, i = [], 0
        for f in wanted:
            out.append(combine(values[i:i + len(f.names)], f))
            i += len(f.names)
        return tf.nest.pack_sequence_as(fetches, out)

    def save(self, saver, path: str) -> str:
        """Write the variables with the user's tf.compat.v1.train.Saver (the
        host's: single-device names, so a one-device script restores it)."""
        d = saver.saver_def
        return self.run(d.save_tensor_name, {d.filename_tensor_name: path})

    def restore(self, saver, path: str) -> None:
        d = saver.saver_def
        self.run(d.restore_op_name, {d.filename_tensor_name: path})

    def _after_run(self, fetched: set[str]) -> None:
        """After a run that initialized: worker 0's values everywhere (a job),
        then the newest checkpoint, once; every `checkpoint.every_steps`
        training steps (the global step's value, else runs), a checkpoint."""
        if fetched & self._initializes:
            if self.built.sync is not None:
                self.session.run(self.built.sync, options=self._timeout)
            if self._checkpoints is not None and not self._restored:
                self._restored = True
                latest = self._checkpoints.latest()
                if latest:
                    self._checkpoints.restore(self.session, latest)
        if self._checkpoints is not None and fetched & self._trains:
            self._steps += 1
            step = self._checkpoints.global_step(self.session)
            step = self._steps if step is None else step
            if step % self.config.checkpoint.every_steps == 0:
                self._checkpoints.save(self.session, step)

    def close(self) -> None:
        self.session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- names ----------------------------------------------------------------
    def _user_name(self, leaf) -> str:
        if isinstance(leaf, tf.Variable):
            element = getattr(leaf, "_graph_element", None)
            leaf = element if element is not None else leaf.op.outputs[0]
        if isinstance(leaf, (tf.Tensor, tf.Operation)):
            if leaf.graph is not self.tg.graph:
                raise FetchError(f"{leaf.name!r} belongs to another graph than the one "
                                 "given to get_runner")
            return leaf.name
        if isinstance(leaf, str):
            return leaf
        raise FetchError(f"cannot fetch or feed a {type(leaf).__name__}; use a tensor, an op, "
                         "a variable or a name from the training graph")

    def _fetch(self, leaf) -> Fetch:
        name = self._user_name(leaf)
        node = name.split(":")[0]
        try:
            element = self.tg.graph.as_graph_element(name)
        except (KeyError, ValueError) as e:
            raise FetchError(f"{name!r} is not in the training graph: {e}") from None
        if node not in self.tg.ir and node not in self._late:
            self._adopt(element if isinstance(element, tf.Operation) else element.op)
        if isinstance(element, tf.Operation):
            if node in self.built.forward:
                raise FetchError(f"op {name!r} is part of the forward pass, which runs layer "
                                 "by layer; fetch the training op or a tensor instead")
            return Fetch((name,), "none", node)
        if name == self.layering.loss or _identity_of(element) == self.layering.loss:
            return Fetch((self.built.loss.name,), "first", node)
        if name in self.built.clones:
            how = self.config.fetch_reduction.get(name) or self.config.fetch_reduction.get(
                node) or _reduction(element)
            return Fetch(tuple(self.built.clones[name]), how, node)
        if node in self.layering.segment_of:
            raise FetchError(f"{name!r} is a read of a variable in the forward pass; fetch "
                             "the variable")
        reads = self._reads_forward(node)
        if reads:
            raise FetchError(
                f"{name!r} reads the forward pass ({reads!r}) but the loss does not depend on "
                "it; layer-by-layer execution computes the loss's ancestors only (fetch the "
                "tensors it is computed from, e.g. the logits, and finish in NumPy)")
        return Fetch((name,), "first", node)

    def _adopt(self, op: tf.Operation) -> None:
        """Copy an op made after get_runner (and the ops it needs that are
        new too) onto the host, reading the existing ops by name."""
        known, new, stack = self.tg.ir, {}, [op]
        while stack:
            o = stack.pop()
            if o.name in known or o.name in new:
                continue
            new[o.name] = o
            stack += [t.op for t in o.inputs] + list(o.control_inputs)
        outside = {t.op.name for o in new.values() for t in o.inputs if t.op.name not in new}
        outside |= {c.name for o in new.values() for c in o.control_inputs
                    if c.name not in new}
        forward = self.built.forward | set(self.layering.sources)
        reads = sorted(n for n in outside if n in forward or self._reads_forward(n))
        if reads:
            raise FetchError(
                f"{op.name!r} reads the forward pass ({reads[0]!r}) but the loss does not "
                "depend on it; layer-by-layer execution computes the loss's ancestors only "
                "(fetch the tensors it is computed from, e.g. the logits, and finish in NumPy)")
        gd = tf.compat.v1.GraphDef()
        controls = {}
        for node in self.tg.graph.as_graph_def().node:
            if node.name not in new:
                continue
            nd = gd.node.add()
            nd.CopyFrom(node)
            nd.device = ""
            if "_class" in nd.attr:
                del nd.attr["_class"]
            inputs = list(nd.input)
            del nd.input[:]
            for ref in inputs:
                src, _, control = parse_input(ref)
                if control and src not in new:
                    controls.setdefault(nd.name, []).append(src)
                else:
                    nd.input.append(ref)
        imap = {f"{t.op.name}:{t.value_index}": self.graph.get_tensor_by_name(t.name)
                for o in new.values() for t in o.inputs if t.op.name not in new}
        with self.graph.as_default(), tf.device(self.plan.host):
            tf.graph_util.import_graph_def(gd, input_map=imap, name="")
        for name, srcs in controls.items():
            compat.add_control_inputs(self.graph.get_operation_by_name(name),
                                      [self.graph.get_operation_by_name(x) for x in srcs])
        if outside & self._initializes:
            self._initializes = self._initializes | set(new)
        self._late.update(new)

    def _reads_forward(self, node: str) -> str | None:
        """A forward op or data source `node` depends on, if any (running it
        would run the user's forward whole, on the host, on another batch)."""
        if node not in self._forward_reads:
            forward = self.built.forward | set(self.layering.sources)
            hit = sorted(self.tg.ir.ancestors([node]) & forward)
            self._forward_reads[node] = hit[0] if hit else None
        return self._forward_reads[node]

    def _feed_key(self, key) -> str:
        name = self._user_name(key)
        name = name if ":" in name else name + ":0"
        return name

    def _check_feed(self, name: str, value) -> None:
        if name in self._split and np.ndim(value) and np.shape(value)[0] % self._parts:
            raise FetchError(f"feed {name!r} has {np.shape(value)[0]} rows, which do not split "
                             f"into {self._parts} equal parts (replicas x micro-batches)")


class Checkpoints(Checkpointer):
    """Every variable of the user's graph (under its single-device name, as
    a plain tf.compat.v1.train.Saver reads it) and the position of the
    input iterators, saved to `<dir>/model.ckpt-<step>` (a job's worker i:
    `<dir>/worker-<i>/`); restored into the host's variables. Saving,
    finding and restoring are Checkpointer's."""

    def __init__(self, graph: tf.Graph, tg, directory: str, host: str, workers: int = 1,
                 worker: int = 0):
        self.directory = (os.path.join(directory, f"worker-{worker}") if workers > 1
                          else directory)
        # each worker's file holds all (Checkpointer's one-process layout)
        self.inputs, self.workers, self.worker, self.timeout = self.directory, 1, 0, 0.0
        variables = sorted(tg.variables)
        step = tf.compat.v1.train.get_global_step(tg.graph)
        with graph.as_default(), tf.device(host), tf.compat.v1.name_scope("l2l/checkpoint/"):
            self.prefix = tf.compat.v1.placeholder(tf.string, [], name="prefix")
            self.input_prefix = self.prefix
            tensors = [read_value(graph, tg.variables[v]) for v in variables]
            names = list(variables)
            iterators = [n.name for n in tg.ir.nodes if n.op in ITERATOR_OPS]
            for it in iterators:
                names.append(f"parallax/iterator/{worker}/{it}")
                tensors.append(tf.raw_ops.SerializeIterator(
                    resource_handle=graph.get_tensor_by_name(it + ":0"),
                    external_state_policy=0))
            self.save_op = tf.raw_ops.SaveV2(prefix=self.prefix, tensor_names=names,
                                             shape_and_slices=[""] * len(names),
                                             tensors=tensors)
            loaded = tf.raw_ops.RestoreV2(prefix=self.prefix, tensor_names=names,
                                          shape_and_slices=[""] * len(names),
                                          dtypes=[t.dtype.base_dtype for t in tensors])
            restores = [assign_value(graph, v, value) for v, value in zip(variables, loaded)]
            restores += [tf.raw_ops.DeserializeIterator(
                resource_handle=graph.get_tensor_by_name(it + ":0"), serialized=value)
                for it, value in zip(iterators, loaded[len(variables):])]
            self.restore_op = tf.group(*restores, name="restore")
            self.step = (tensors[variables.index(step.op.name)]
                         if step is not None and step.op.name in tg.variables else None)

    def global_step(self, session):
        return None if self.step is None else int(session.run(self.step))


def _identity_of(t: tf.Tensor) -> str:
    """The tensor `t` is a chain of Identity ops of (tf.gradients makes no op
    for an Identity, so a loss found from its gradients is the one before)."""
    while t.op.type == "Identity":
        t = t.op.inputs[0]
    return t.name


def _reduction(t: tf.Tensor) -> str:
    if not (t.dtype.is_floating or t.dtype.is_integer):
        return "first"
    return "mean" if t.shape.rank == 0 else "concat"
