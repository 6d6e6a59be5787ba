"""Layer-to-layer execution as a Program for the one Runner: the L2L graph
and the user's fetches on it.

Requires: a TrainingGraph, the devices that are replicas, a Config whose
`l2l.layers` is set.
Guarantees: `l2l_runner(tg, job)` is a Runner (parallax_ng/runtime/runner.py)
whose `run(fetches, feed_dict)` takes what the user's single-device
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
`run(..., per_replica=True)` is an error that says why. `plan` says how the
model was cut (printable). With `checkpoint.dir`, checkpoints are the
Runner's: every variable of the user's graph under its single-device name
and the position of the input iterators, the newest restored by the first
run that initializes, saved every `checkpoint.every_steps` training steps
and at close (a job's worker 0 writes the variables, every worker its
input positions).
"""
from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

import numpy as np
import tensorflow as tf

from .. import compat
from ..errors import ConfigError, FetchError
from ..graph import averaging, forms
from ..graph.ir import parse_input
from ..graph.rules import past_identities
from ..pipeline.results import Barrier
from ..resources import check_devices, session_config
from ..runtime.batch_parts import sparse_placeholders
from ..runtime.checkpoint import Checkpointer, Layout
from ..runtime.combining import Fetch, default_reduction
from ..runtime.executor import Executor
from ..runtime.fetches import FetchMap
from ..runtime.program import Program, run_options
from ..runtime.runner import Runner
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


def l2l_runner(tg, job) -> Runner:
    """The Runner of layer-to-layer execution of `tg` for a build.Job: on
    this machine's devices, or as one worker of a job (its own host the EPS)."""
    config, info = job.config, job.cluster
    if config.communication.compression != "none":
        warnings.warn(f"config key 'communication.compression' is "
                      f"{config.communication.compression}, but layer-to-layer execution "
                      "sums its gradients across workers in float32 (its host's sums are not "
                      "compressed)", stacklevel=4)
    if info is None:
        devices = job.resources.hosts[0].devices
        check_devices(devices)
        return Runner(l2l_program(tg, config, [l2l.device_string(kind, i)
                                               for kind, i in devices]),
                      config, session_config(devices))
    if info.task_type != "worker" or info.ps:
        raise ConfigError("config key 'l2l': every worker's host is its parameter server; "
                          "list no 'ps' in the resources")
    check_devices(info.devices, f"worker {info.task} ({info.workers[info.task]})")
    server = info.start_server()
    program = l2l_program(tg, config, info.device_strings(), info.host,
                          (len(info.workers), info.task))
    return Runner(program, config, info.session_config(), server=server)


def l2l_plan(tg, job) -> L2LPlan:
    """How layer-to-layer execution cuts `tg` for a build.Job (nothing is built)."""
    info, cfg = job.cluster, job.config.l2l
    if info is not None:
        return plan_of(layers.split(tg, cfg.layers, cfg.loss), info.device_strings(),
                       info.host, cfg, (len(info.workers), 0))
    devices = [l2l.device_string(kind, i) for kind, i in job.resources.hosts[0].devices]
    return plan_of(layers.split(tg, cfg.layers, cfg.loss), devices,
                   l2l.device_string("CPU", 0), cfg)


def l2l_program(tg, config, devices: list[str], host: str | None = None,
                job: tuple[int, int] = (1, 0)) -> Program:
    """The L2L graph of `tg` over the replicas `devices` (device strings),
    with the variables on `host`; `job`: (workers, this worker). Its one
    barrier is the collective giving every worker worker 0's values after
    they are initialized; checkpoints have the layout of a data-parallel
    job whose variables are on every worker (runtime/checkpoint.py)."""
    cfg = config.l2l
    layering = layers.split(tg, cfg.layers, cfg.loss)
    host = host or l2l.device_string("CPU", 0)
    dense, sparse, note = averaging.averages(config, tg.graph)
    if note and job[1] == 0:
        warnings.warn(note, stacklevel=3)
    built = l2l.build(tg, layering, cfg, list(devices), host, job, average=(dense, sparse),
                      backend=config.communication.backend)
    plan = plan_of(layering, devices, host, cfg, job)
    timeout = config.communication.timeout_seconds
    options = run_options(timeout)
    sync = built.sync.name if built.sync is not None else None
    executor = Executor(built.graph, options,
                        barrier=Barrier(sync, sync, folded=True) if sync else None,
                        worker=job[1])
    checkpoints = None
    if config.checkpoint.dir:
        layout = Layout(tg, host, worker=job[1], workers=job[0], offset=job[1])
        checkpoints = Checkpointer(built.graph, layout, config.checkpoint.dir, timeout)
    fetches = L2LFetchMap(built.graph, tg, config, built, layering, plan.host,
                          len(devices) * cfg.micro_batches)
    return Program(built.graph, tg, plan, fetches, executor, options, checkpoints,
                   worker=job[1])


class L2LFetchMap(FetchMap):
    """The user's fetches on the L2L graph: the loss is the step's mean
    loss; another tensor of the forward pass comes from every replica's
    micro-batches; everything else from the host, under the user's names."""

    def __init__(self, graph, tg, config, built, layering, host: str, parts: int):
        super().__init__(graph, tg, config)
        self.built, self.layering, self.host = built, layering, host
        self._split = {s + ":0" for s in layering.sources} & {
            op.name + ":0" for op in tg.graph.get_operations() if op.type == "Placeholder"}
        self._parts = parts          # replicas x micro-batches
        self._forward_reads: dict[str, str | None] = {}

    def fetch(self, leaf, per_replica: bool = False) -> Fetch:
        name = self.user_name(leaf)
        if per_replica:
            raise FetchError("run(..., per_replica=True) is not available with layer-to-layer "
                             "execution: a replica's values are its micro-batches'; fetch "
                             "the combined value")
        node = name.split(":")[0]
        element = self.user_graph.as_graph_element(name)
        if isinstance(element, tf.Operation):
            if node in self.built.forward:
                raise FetchError(f"op {name!r} is part of the forward pass, which runs layer "
                                 "by layer; fetch the training op or a tensor instead")
            return Fetch((name,), "none", node)
        if name == self.layering.loss or past_identities(element).name == self.layering.loss:
            return Fetch((self.built.loss.name,), "first", node)
        if name in self.built.clones:       # a value of each micro-batch, combined as replicas'
            how, axis, _ = default_reduction(element, forms.sources(self.user_graph))
            how = self.config.fetch_reduction.get(name) or self.config.fetch_reduction.get(
                node) or how
            return Fetch(tuple(self.built.clones[name]), how, node, (),
                         axis if how in ("concat", "shape") else 0)
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

    def feeds(self, feed_dict) -> dict:
        """Feeds go to the host's placeholders; the L2L graph splits a batch
        into replicas x micro-batches, so it must divide evenly."""
        out = {}
        sparse = [k for k in feed_dict or {} if isinstance(k, tf.SparseTensor)]
        names = {n if ":" in n else n + ":0" for n in
                 (self.user_name(k) for k in feed_dict or {} if k not in sparse)}
        sparse = [k.indices.name.rsplit("/", 1)[0] for k in sparse] + \
            sparse_placeholders(names)
        if major := sorted(n for n in names if n.split(":")[0] in self.tg.time_major):
            raise FetchError(f"layer-by-layer execution does not split placeholders fed "
                             f"time-major ({major[0]!r}, graph/time_major.py): its graph splits "
                             "each fed batch by its first dimension; feed it batch-major and "
                             "transpose it in the graph")
        if sparse:
            raise FetchError(f"layer-by-layer execution does not split sparse placeholders "
                             f"({sparse[0]!r}): its graph splits each fed batch by its first "
                             "dimension, which a SparseTensor's entries are not; feed the ids "
                             "as a dense batch (padded per row)")
        for key, value in (feed_dict or {}).items():
            name = self.user_name(key)
            name = name if ":" in name else name + ":0"
            if name in self._split and np.ndim(value) and np.shape(value)[0] % self._parts:
                raise FetchError(f"feed {name!r} has {np.shape(value)[0]} rows, which do not "
                                 f"split into {self._parts} equal parts (replicas x "
                                 "micro-batches)")
            out[name] = value
        return out

    def _adopt(self, node: str) -> bool:
        """Copy an op made after get_runner (and the ops it needs that are
        new too) onto the host, reading the existing ops by name."""
        new = self._new_ops(node)
        if new is None:
            return False
        outside = {t.op.name for o in new.values() for t in o.inputs if t.op.name not in new}
        outside |= {c.name for o in new.values() for c in o.control_inputs
                    if c.name not in new}
        forward = self.built.forward | set(self.layering.sources)
        reads = sorted(n for n in outside if n in forward or self._reads_forward(n))
        if reads:
            raise FetchError(
                f"{node!r} reads the forward pass ({reads[0]!r}) but the loss does not "
                "depend on it; layer-by-layer execution computes the loss's ancestors only "
                "(fetch the tensors it is computed from, e.g. the logits, and finish in NumPy)")
        gd = tf.compat.v1.GraphDef()
        controls = {}
        for o in self.user_graph.get_operations():
            if o.name not in new:
                continue
            nd = gd.node.add()
            nd.CopyFrom(o.node_def)
            nd.device = ""
            if "_class" in nd.attr:
                del nd.attr["_class"]
            del nd.input[:]
            for ref in o.node_def.input:
                src, _, control = parse_input(ref)
                if control and src not in new:
                    controls.setdefault(nd.name, []).append(src)
                else:
                    nd.input.append(ref)
        imap = {f"{t.op.name}:{t.value_index}": self.graph.get_tensor_by_name(t.name)
                for o in new.values() for t in o.inputs if t.op.name not in new}
        with self.graph.as_default(), tf.device(self.host):
            tf.graph_util.import_graph_def(gd, input_map=imap, name="")
        for name, srcs in controls.items():
            compat.add_control_inputs(self.graph.get_operation_by_name(name),
                                      [self.graph.get_operation_by_name(x) for x in srcs])
        self.late.update({name: [name] for name in new})
        return True

    def _reads_forward(self, node: str) -> str | None:
        """A forward op or data source `node` depends on, if any (running it
        would run the user's forward whole, on the host, on another batch)."""
        if node not in self._forward_reads:
            forward = self.built.forward | set(self.layering.sources)
            hit = sorted(self.tg.ir.ancestors([node]) & forward)
            self._forward_reads[node] = hit[0] if hit else None
        return self._forward_reads[node]
