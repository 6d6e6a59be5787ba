"""Layer-to-layer (L2L) execution: one layer on the device at a time.

Requires: a TrainingGraph, its Layering (parallax_ng/l2l/layers.py), the
replicas' devices and the host device, and the `l2l` config.
Guarantees: `build(...)` returns an L2LGraph: a new tf.Graph where
- every variable, optimizer slot and the user's update ops live on the host
  (the eager parameter server, EPS): the user's graph is imported there with
  each gradient replaced by the sum of what the layers sent;
- each replica's batch is split into `micro_batches` parts; the forward runs
  layer by layer, each layer over every micro-batch before the next layer
  (inner looping); only tensors crossing layer boundaries are kept (the
  stash: on the device, or copied to the host with `stash: host`);
- the backward goes through the layers in reverse; each layer is recomputed
  from its stash and differentiated (tf.gradients of the layer's copy) for
  its weights and its inputs;
- a layer's weights are read from the host and copied to the device once per
  pass (forward, backward) for all micro-batches; the next layer's copy
  starts when the current layer starts (so at most two layers' weights are
  on a device); a layer's weight gradients are added on the host as each
  micro-batch's arrive (per replica, then across replicas: parallax_ng/l2l/eps.py),
  and the optimizer of a variable runs as soon as its sum is complete;
- the order is fixed by control edges: on each device one (layer,
  micro-batch) task after another, so the device's memory is the weights of
  at most two layers, one micro-batch's activations and the stash, whatever
  the depth.
The sum equals the gradient of the mean loss over the replicas' whole
batches: each micro-batch's loss gradient is scaled by 1/(replicas x
micro-batches) for a loss that is a mean over the batch, by 1/replicas for
a sum over it (graph/forms.py loss_form), so a step equals one step of the user's
graph on the global batch; with average_dense/average_sparse false the
replicas' sums are added instead. Under cmp every update waits until
every sum is checked finite (an overflow is an error, and no update runs).
Random ops in the forward (dropout; the kinds in layers.STATELESS) are
drawn again by their recomputation: every copy of one draws from the
stateless op of its kind, with the seed [step, salt + key]. step is the
user's global step as the step starts when the graph has one (so a resumed
run draws what an uninterrupted one draws), else a number drawn once per
run on the host (from the graph's seed when it has one); salt is the
graph's seed (else a random number) times 2^32; key = (i x replicas +
replica) x micro_batches + micro_batch, i being the op's position in
`Layering.random` and replica its index in the job. So a (replica,
micro-batch) draws the same numbers in its forward and its backward,
other ones than every other (replica, micro-batch), and new ones every
step.
Where the graph holds a replica's batch size as a constant that a
micro-batch needs as its own size (micro.py lists the patterns),
the copies read a constant of the micro-batch's size instead; any other
constant that no longer fits is a GraphError naming the op.
A copy "to the device" is a real copy (DeepCopy) when the device is a CPU
device standing in for an accelerator; for a GPU it is TensorFlow's own
host-to-device transfer.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field

import tensorflow as tf

from .. import compat
from ..comm.lowering import host_lowering
from ..errors import GraphError
from ..graph import rules
from ..graph.forms import loss_form
from ..graph.ir import parse_input
from . import eps
from .copies import Copies
from .draws import Seeds
from .layers import Layering
from .micro import MicroBatches, apart

PREFIX = "l2l"


@dataclass
class L2LGraph:
    graph: tf.Graph
    loss: tf.Tensor                           # mean loss of the step (host)
    clones: dict[str, list[str]]              # forward tensor -> its copies, replica-major
    forward: set[str]                         # user forward op names (not to be run)
    devices: list[str]
    segments: list[str] = field(default_factory=list)
    sync: tf.Operation | None = None          # a job: worker 0's variables everywhere


def device_string(kind: str, index: int, task: str = "/job:localhost/replica:0/task:0") -> str:
    return f"{task}/device:{kind}:{index}"


def build(tg, layering: Layering, cfg, devices: list[str], host: str,
          job: tuple[int, int] = (1, 0), average=(True, True), backend: str = "tf") -> L2LGraph:
    """`job`: (workers, this worker) of a multi-process job, where every
    worker's host is an EPS of its own: the workers' sums are all-reduced
    (a sparse gradient as its dense sum and a mask of the rows touched),
    each applies the same update, and `sync` makes every worker's
    variables worker 0's (run after initializing). `average`: whether the
    replicas' gradients of dense and of sparse variables are averaged (the
    config's average_dense, average_sparse) or summed; `backend`: the
    config's communication.backend (its hosts' collectives)."""
    return _Builder(tg, layering, cfg, devices, host, job, average, backend).build()


class _Builder:
    def __init__(self, tg, layering, cfg, devices, host, job, average=(True, True),
                 backend="tf"):
        self.tg, self.lay, self.cfg = tg, layering, cfg
        self.devices, self.host = devices, host
        self.u = cfg.micro_batches
        self.half = cfg.precision == "cmp"
        self.scale = cfg.loss_scale if self.half else 1.0
        # a micro-batch's loss in its replica's loss: averaged for a mean over
        # the batch (or when the graph does not show), added for a sum
        self.micro = MicroBatches(tg, layering, self.u, host, PREFIX)
        self.loss_form = form = loss_form(tg.graph.get_tensor_by_name(layering.loss),
                                          layering.sources, self.micro.batch_size())
        self.weight = 1.0 if form.kind == "sum" else 1.0 / self.u
        if self.u > 1 and (why := apart(tg, layering, form, self.u)):
            warnings.warn(why, stacklevel=4)
        whole = [t.name for t in self.micro.whole_feeds()]
        if self.loss_form.kind == "sum" and self.u > 1 and whole:
            raise GraphError(
                f"the loss {layering.loss!r} sums over the batch, and placeholder {whole[0]!r} "
                "has a fixed first dimension, so every micro-batch would get all its rows "
                "and add them again: build it with shape [None, ...] to split it")
        self.average = average
        self.n = len(devices)
        self.job = eps.Workers(host_lowering(backend, *job))
        self.total = self.n * self.job.workers       # replicas in the job
        self.graph = tf.Graph()
        gd = tg.ir.graph_def
        self.nodes = {n.name: n for n in gd.node}
        self.library, self.versions = gd.library, gd.versions
        if self.job.workers > 1:
            self.nodes, self.library = eps.shard_inputs(
                self.nodes, self.library, tg.shard_consts, *job)
        self.copies = Copies(self.nodes, self.library, self.versions, self.graph, tg.graph,
                             host, PREFIX)
        self.contrib: dict[str, list] = {}     # variable -> [(replica, gradient)]
        self.clones: dict[str, list[str]] = {}
        self.seeds = Seeds(tg.graph, self.graph, layering.random, host, PREFIX, self.n,
                           self.total, self.u, self.job.worker)
        self._tables: dict[str, dict] = {}         # segment -> _gathered

    # -- the whole graph --------------------------------------------------
    def build(self) -> L2LGraph:
        state = self._state_nodes()
        with self.graph.as_default():
            self.copies.copy(state, "", {}, self.host)
            data = [self._data(r) for r in range(self.n)]
            losses = []
            for r, device in enumerate(self.devices):
                losses += self._replica(r, device, data[r])
            with tf.device(self.host):
                grads = eps.reduced(self.tg, self.contrib, self.n, self.job, self.scale,
                                    self.average, self.half, f"{PREFIX}/eps/")
            rest = [name for name in self.nodes if name not in state]
            # the update path's control edges back into the user's forward and
            # backward (gradients grouped by tf.tuple) would run them whole
            user_step = self.tg.ir.ancestors({r.node for r in self.tg.gradient_tensors})
            self.copies.copy(rest, "", grads, self.host, keep_controls=state,
                             drop=user_step)
            with tf.device(self.host):
                sync = self.job.sync(self.graph, self.tg.variables, f"{PREFIX}/sync")
            with tf.device(self.host), tf.name_scope(f"{PREFIX}/loss"):
                loss = tf.add_n([tf.cast(x, self.lay_loss_dtype) for x in losses]) * (
                    self.weight / self.n)
        eps.check_updates(self.graph, self.tg, self.lay.segments)
        return L2LGraph(self.graph, loss, self.clones,
                        {n for s in self.lay.segments for n in s.ops}, self.devices,
                        [s.name for s in self.lay.segments], sync)

    def _state_nodes(self) -> set[str]:
        """Variables, data sources and the input pipeline: made first, since
        the layers' copies use them (the rest of the user's graph comes last,
        its gradients mapped to the layers' sums)."""
        roots = [n for n, node in self.nodes.items() if node.op in rules.VARIABLE_OPS]
        return self.tg.ir.ancestors(roots + list(self.lay.sources))

    # -- data ---------------------------------------------------------------
    def _data(self, r: int) -> list[dict[str, tf.Tensor]]:
        """Per micro-batch: source tensor name -> replica r's part (host)."""
        parts = [{} for _ in range(self.u)]
        with tf.device(self.host), tf.name_scope(f"{PREFIX}/data_{r}"):
            for name in self.lay.sources:
                op = self.graph.get_operation_by_name(name)
                if op.type == "Placeholder":
                    outs = [(op.outputs[0], self.n * self.u, r)]
                else:
                    op = op if r == 0 else self._next_batch(op, r)
                    outs = [(t, self.u, None) for t in op.outputs]
                for t, ways, replica in outs:
                    pieces = self.micro.split(t, ways, self.n)
                    key = f"{name}:{t.value_index}"
                    base = replica * self.u if replica is not None else 0
                    for k in range(self.u):
                        parts[k][key] = t if pieces is None else pieces[base + k]
        return parts

    def _next_batch(self, first: tf.Operation, r: int) -> tf.Operation:
        """Replica r's own get_next from the same iterator, after replica r-1's
        (replicas take consecutive batches, as shards of one stream)."""
        prev = self._last_batch if r > 1 else first
        with tf.control_dependencies([prev]):
            outs = getattr(tf.raw_ops, first.type)(
                iterator=first.inputs[0], output_types=first.get_attr("output_types"),
                output_shapes=first.get_attr("output_shapes"), name="get_next")
        self._last_batch = outs[0].op
        return outs[0].op

    # -- one replica's schedule --------------------------------------------
    def _replica(self, r: int, device: str, data) -> list[tf.Tensor]:
        segs = self.lay.segments
        last = len(segs) - 1
        phases = [("f", s) for s in range(last)] + [("b", s) for s in range(last, -1, -1)]
        stash = [dict(d) for d in data]            # per micro-batch: tensor name -> value
        grads_out = [{} for _ in range(self.u)]    # per micro-batch: tensor -> its gradient
        done_of_phase, prev = [], None
        losses = []
        for j, (kind, s) in enumerate(phases):
            gate = done_of_phase[j - 2] if j >= 2 else None
            weights = self._load(segs[s], device, gate, f"r{r}/{kind}{s}")
            for k in range(self.u):
                scope = f"{PREFIX}/r{r}/{kind}{s}/m{k}"
                if kind == "f":
                    prev = self._forward(segs[s], device, weights, stash[k], prev, scope,
                                         (r, k))
                else:
                    prev, loss = self._backward(s, device, weights, stash[k], grads_out[k],
                                                prev, scope, (r, k))
                    if loss is not None:
                        losses.append(loss)
            done_of_phase.append(prev)
        return losses

    def _load(self, seg, device, gate, scope) -> dict[str, tf.Tensor]:
        """The segment's weights on `device`: read on the host once `gate` ran
        (a table the segment only gathers from stays on the host)."""
        out = {}
        gathered = self._gathered(seg)
        with tf.name_scope(f"{PREFIX}/{scope}/load/"):
            for var in seg.weights:
                v = self.graph.get_operation_by_name(var)
                with tf.device(self.host), tf.control_dependencies([gate] if gate else []):
                    if v.type == "VarHandleOp":
                        value = tf.raw_ops.ReadVariableOp(resource=v.outputs[0],
                                                          dtype=v.get_attr("dtype"))
                    else:
                        value = tf.identity(v.outputs[0])
                    if var in gathered:
                        out[var] = value
                        continue
                    value = self._halved(value)
                # differentiated as itself, not back through the read into the
                # variable's handle (which a gather in the segment may also use)
                with tf.device(device):
                    out[var] = tf.stop_gradient(_move(value, device))
        return out

    def _gathered(self, seg) -> dict[str, set[str]]:
        """Variable -> the gathers of it in `seg`, for each variable the
        segment only gathers rows from (a reference variable's embedding
        table: its read feeds Gather ops, which run on the host as a
        resource variable's ResourceGather does)."""
        if seg.name in self._tables:
            return self._tables[seg.name]
        out = self._tables[seg.name] = {}
        g, ops = self.tg.graph, set(seg.ops)
        for var, reads in seg.weights.items():
            users = [(c, read) for read in reads for c in g.get_operation_by_name(read)
                     .outputs[0].consumers() if c.name in ops]
            if users and all(c.type in ("Gather", "GatherV2") and c.inputs[0].op.name == read
                             for c, read in users):
                out[var] = {c.name for c, _ in users}
        return out

    def _input_map(self, seg, weights, stash, device, gate) -> dict[str, tf.Tensor]:
        imap = {}
        for var, reads in seg.weights.items():
            for read in reads:
                imap[read + ":0"] = weights[var]
        for var in seg.handles:
            imap[var + ":0"] = self.graph.get_tensor_by_name(var + ":0")
        for t in seg.inputs:
            imap[t] = self._use(self._halved(stash[t]), device, gate)
        return imap

    def _halved(self, t: tf.Tensor) -> tf.Tensor:
        """t as the device computes it: float16 under cmp, cast where t is."""
        if not self.half or t.dtype != tf.float32:
            return t
        with tf.device(t.device or self.host):
            return tf.cast(t, tf.float16)

    def _use(self, t: tf.Tensor, device: str, gate) -> tf.Tensor:
        if _same_device(t.device, device):
            return t
        with tf.control_dependencies([gate] if gate else []):
            return _move(t, device)

    def _clone(self, seg, imap, device, scope, gate, task) -> dict[str, tf.Operation]:
        names = set(seg.ops) | self._free_inputs(seg.ops)
        on_host = {name for name in seg.ops
                   if any(not control and src in seg.handles for src, _, control in
                          map(parse_input, self.nodes[name].input))}
        on_host.update(*self._gathered(seg).values())
        seeds = {name: self.seeds.seed(name, *task) for name in seg.ops
                 if name in self.lay.random}
        try:
            made = self.copies.copy(names, scope, imap, device, on_host=on_host,
                                    half=self.half, seeds=seeds,
                                    rewire=self.micro.constants(seg, self.loss_form.by_batch))
        except ValueError as e:
            batch = self.micro.batch_size()
            size = (f"micro-batches of {batch // self.u} (a replica's batch {batch} in "
                    f"{self.u} parts)" if batch else f"{self.u} micro-batches")
            raise GraphError(
                f"layer-by-layer execution runs each layer on {size}, and TensorFlow refused "
                f"the layer's copy: {str(e).replace(scope + '/', '').rstrip('.')}. A shape "
                "built from the batch size (a Python number in tf.reshape, tf.zeros, tf.ones "
                "or tf.fill) does not fit a micro-batch: take it from the tensor "
                "(tf.shape(x)[0]), or set l2l.micro_batches: 1") from None
        if gate is not None:
            inside = set(made.values())
            for op in made.values():
                if not any(t.op in inside for t in op.inputs):
                    compat.add_control_inputs(op, [gate])
        return made

    def _free_inputs(self, ops) -> set[str]:
        out, todo = set(), list(ops)
        while todo:
            node = self.nodes[todo.pop()]
            for ref in node.input:
                src = parse_input(ref)[0]
                if src in self.lay.free and src not in out:
                    out.add(src)
                    todo.append(src)
        return out

    def _forward(self, seg, device, weights, stash, gate, scope, task):
        made = self._clone(seg, self._input_map(seg, weights, stash, device, gate),
                           device, scope, gate, task)
        kept = []
        for t in seg.outputs:
            value = _tensor(made, t)
            if self.cfg.stash == "host":
                value = _move(value, self.host)
            stash[t] = value
            kept.append(value.op)
        self._note_clones(seg, made)
        with tf.device(device):
            return tf.group(*kept, name=f"{scope}/done")

    def _backward(self, s, device, weights, stash, grads_out, gate, scope, task):
        r = task[0]
        seg = self.lay.segments[s]
        imap = self._input_map(seg, weights, stash, device, gate)
        made = self._clone(seg, imap, device, scope, gate, task)
        if s == len(self.lay.segments) - 1:      # the last layer runs in the backward only
            self._note_clones(seg, made)
        ys, grad_ys = [], []
        for t in seg.outputs:
            if t in grads_out:
                ys.append(_tensor(made, t))
                grad_ys.append(self._use(grads_out[t], device, gate))
        loss = None
        if self.lay.loss.rsplit(":", 1)[0] in made:
            loss = _tensor(made, self.lay.loss)
            ys.append(loss)
            with tf.device(device):
                grad_ys.append(tf.constant(self.scale * self.weight / self.total, loss.dtype,
                                           name=f"{scope}/loss_scale"))
        xs, what = [], []
        for var in seg.weights:
            if var in self.tg.gradients:
                xs.append(weights[var])
                what.append(("w", var))
        for var in seg.handles:
            if var in self.tg.gradients:
                xs.append(self.graph.get_tensor_by_name(var + ":0"))
                what.append(("w", var))
        for t in seg.inputs:
            if t not in self.lay_sources_tensors and imap[t].dtype.is_floating:
                xs.append(imap[t])
                what.append(("x", t))
        if not ys or not xs:
            return gate, loss
        with tf.device(device), tf.name_scope(f"{scope}/grad"):
            grads = tf.gradients(ys, xs, grad_ys=grad_ys)
        done = []
        for (kind, key), g in zip(what, grads):
            if g is None:
                continue
            done.append(g.values.op if isinstance(g, tf.IndexedSlices) else g.op)
            if kind == "w":
                self.contrib.setdefault(key, []).append((r, g))
                continue
            with tf.device(device):
                g = tf.convert_to_tensor(g)
                if key in grads_out:        # read by several later segments: sum
                    g = g + self._use(grads_out[key], device, gate)
            grads_out[key] = _move(g, self.host) if self.cfg.stash == "host" else g
            done.append(grads_out[key].op)
        with tf.device(device):
            return tf.group(*done, name=f"{scope}/done"), loss

    @property
    def lay_loss_dtype(self) -> tf.DType:
        return self.tg.graph.get_tensor_by_name(self.lay.loss).dtype

    @property
    def lay_sources_tensors(self) -> set[str]:
        if not hasattr(self, "_source_tensors"):
            self._source_tensors = {t.name for name in self.lay.sources
                                    for t in self.tg.graph.get_operation_by_name(name).outputs}
        return self._source_tensors

    def _note_clones(self, seg, made):
        for name in seg.ops:
            for t in made[name].outputs:
                self.clones.setdefault(f"{name}:{t.value_index}", []).append(t.name)




def _tensor(made: dict, name: str) -> tf.Tensor:
    op, _, index = name.rpartition(":")
    return made[op].outputs[int(index)]


def _same_device(a: str, b: str) -> bool:
    if not a:
        return False
    x, y = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (x.device_type, x.device_index) == (y.device_type, y.device_index)


def _move(t: tf.Tensor, device: str) -> tf.Tensor:
    """t on `device`: a copy of its own there (DeepCopy for a CPU device, so
    its bytes are the device's; TensorFlow's transfer for a GPU)."""
    with tf.device(device):
        if tf.DeviceSpec.from_string(device).device_type == "CPU":
            return tf.raw_ops.DeepCopy(x=t)
        return tf.identity(t)
