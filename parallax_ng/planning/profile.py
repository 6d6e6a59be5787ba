"""Profile: what the first training steps measure, for the planner.

Requires: the runner's first training runs, traced (RunOptions FULL_TRACE),
with replica 0's sparse gradient indices fetched along.
Guarantees: a `Profile` per run and merged over runs: per trained variable
the distinct rows its gradient touched (sparse variables: how many, and a
sorted sample of which a worker's steps touch, `touched`) and when its
gradient became ready (seconds from the step's first op, replica 0); the
forward time (until the first autodiff op started); and layers: variables
whose gradients became ready within `TOGETHER` of each other, in backward
order, each with its backward time (since the previous layer was ready).
`apply(info)` gives the analysis with measured sparsity; `simulator(tg)`
the layers in `parallax-ng simulate`'s format (parallax_ng/planning/buckets.py).
With the all-reduce micro-benchmark (parallax_ng/planning/costfit.py) it also holds
the fitted cost a + b*M, which the mgwfbp buckets use.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np

from .. import compat
from ..graph import rules
from .analysis import analyze, forward_depths, unknown_rows
from .costfit import Fit

TOGETHER = 1e-4      # seconds: gradients ready this close belong to one layer
SAMPLE = 1024        # rows touched kept per variable (evenly spaced in sorted order)
TOUCH_STEPS = 8      # worker steps whose distinct rows make the sample


def sample(ids) -> tuple:
    """At most SAMPLE of `ids` (several steps' distinct rows put together,
    so a row touched in every step counts that often), sorted, evenly
    spaced in order: how densely a step touches each range of rows."""
    ids = np.sort(np.asarray(ids, np.int64))
    if len(ids) > SAMPLE:
        ids = ids[np.linspace(0, len(ids) - 1, SAMPLE).round().astype(np.int64)]
    return tuple(int(i) for i in ids)


@dataclass(frozen=True)
class Layer:
    variables: tuple[str, ...]
    backward_time: float        # seconds since the previous layer was ready


@dataclass(frozen=True)
class Profile:
    steps: int
    rows: dict = field(default_factory=dict)       # sparse variable -> distinct rows touched
    ready: dict = field(default_factory=dict)      # variable -> seconds into the step
    forward_time: float = 0.0
    allreduce: Fit | None = None                   # the micro-benchmark's fit, if run
    round_trip: float | None = None                # seconds a server round trip adds to a run
    session_run: float | None = None               # seconds of a session run of one local op
    factor_rows: dict = field(default_factory=dict)  # dense variable -> its factors' rows
    flops: float | None = None                     # a replica's MatMul rate, if measured
    touched: dict = field(default_factory=dict)    # sparse variable -> sample of rows touched

    @property
    def order(self) -> tuple[str, ...]:
        """Trained variables by when their gradients became ready."""
        return tuple(sorted(self.ready, key=lambda v: (self.ready[v], v)))

    def layers(self, together: float = TOGETHER) -> list[Layer]:
        """Variables whose gradients were ready within `together` seconds of
        the first of them (negative: each variable alone), in backward
        order, each with the time since the previous layer (the first:
        since the forward pass ended)."""
        out, group, previous = [], [], self.forward_time
        for var in self.order:
            if group and self.ready[var] - self.ready[group[0]] > together:
                done = self.ready[group[-1]]
                out.append(Layer(tuple(group), done - previous))
                previous, group = done, []
            group.append(var)
        if group:
            out.append(Layer(tuple(group), self.ready[group[-1]] - previous))
        return out

    def scaled(self, factor: float) -> "Profile":
        """The same measurements with every time multiplied by `factor`."""
        return replace(self, ready={v: t * factor for v, t in self.ready.items()},
                       forward_time=self.forward_time * factor)

    def merge(self, other: "Profile") -> "Profile":
        """Two profiles as one: rows and times averaged over their steps
        (the sample of rows touched: the first's)."""
        n = self.steps + other.steps
        mean = lambda a, b: (a * self.steps + b * other.steps) / n   # noqa: E731
        return Profile(
            n, {v: mean(self.rows[v], other.rows.get(v, self.rows[v])) for v in self.rows},
            {v: mean(self.ready[v], other.ready.get(v, self.ready[v])) for v in self.ready},
            mean(self.forward_time, other.forward_time), self.allreduce or other.allreduce,
            self.round_trip if self.round_trip is not None else other.round_trip,
            self.session_run if self.session_run is not None else other.session_run,
            {**other.factor_rows, **self.factor_rows},
            self.flops if self.flops is not None else other.flops,
            {**other.touched, **self.touched})

    def apply(self, info: dict, tg) -> dict:
        """The analysis with measured sparsity: rows touched / rows."""
        out = dict(info)
        for var, rows in self.rows.items():
            total = tg.variables[var].shape[0]
            if total:
                out[var] = replace(info[var], alpha=rows / total, alpha_source="measured",
                                   touched=tuple(self.touched.get(var, ())))
        for var, rows in self.factor_rows.items():
            if out[var].factors and out[var].factors[0] is None:
                out[var] = replace(out[var], factors=(rows, out[var].factors[1]))
        return out

    def measured(self, plan, tg):
        """`plan` with these measurements (no new decisions)."""
        info = self.apply({k: vp.info for k, vp in plan.variables.items()}, tg)
        return replace(plan, variables={k: replace(vp, info=info[k])
                                        for k, vp in plan.variables.items()},
                       schedule=replace(plan.schedule, order=self.order))

    def to_dict(self) -> dict:
        out = {"steps": self.steps, "forward_time": self.forward_time,
               "rows": dict(self.rows), "ready": dict(self.ready),
               "layers": [{"variables": list(layer.variables),
                           "backward_time": layer.backward_time} for layer in self.layers()]}
        if self.allreduce is not None:
            out["allreduce"] = self.allreduce.to_dict()
        if self.round_trip is not None:
            out["round_trip"] = self.round_trip
        if self.session_run is not None:
            out["session_run"] = self.session_run
        if self.factor_rows:
            out["factor_rows"] = dict(self.factor_rows)
        if self.flops is not None:
            out["flops"] = self.flops
        return out

    def simulator(self, tg, per_variable: bool = False) -> dict:
        """The layers input to output, as `parallax-ng simulate` reads them:
        a layer's bytes are its variables' gradient bytes (a sparse one's
        measured distinct rows times a row's bytes); with `per_variable`
        each variable is a layer (as the planner's buckets see them)."""
        layers = []
        for layer in reversed(self.layers(-1.0 if per_variable else TOGETHER)):
            nbytes = 0
            for var in layer.variables:
                v = tg.variables[var]
                rows = self.rows.get(var)
                nbytes += (int(round(rows * v.nbytes / v.shape[0]))
                           if rows is not None and v.shape and v.shape[0] else v.nbytes)
            name = layer.variables[0] + (f" (+{len(layer.variables) - 1})"
                                         if len(layer.variables) > 1 else "")
            layers.append({"name": name, "bytes": nbytes, "backward_time": layer.backward_time,
                           "variables": list(layer.variables)})
        out = {"forward_time": self.forward_time, "layers": layers}
        if self.allreduce is not None:
            out["allreduce"] = self.allreduce.to_dict()
        return out

    def format(self) -> str:
        rows = [f"profile of {self.steps} step(s): forward {self.forward_time * 1e3:.2f} ms",
                f"{'layer (variables ready together)':48} {'ready ms':>9} {'backward ms':>12}"]
        for layer in self.layers():
            t = max(self.ready[v] for v in layer.variables)
            rows.append(f"{', '.join(layer.variables)[:48]:48} {t * 1e3:9.2f} "
                        f"{layer.backward_time * 1e3:12.2f}")
        for var, n in sorted(self.rows.items()):
            rows.append(f"{var}: {n:.1f} distinct rows touched per step")
        if self.allreduce is not None:
            rows.append(self.allreduce.format())
        return "\n".join(rows)


def from_file(path: str) -> Profile:
    """The Profile a file in the simulator's format stands for (as
    `parallax-ng profile` writes it, or by hand): each layer's variables
    (`variables`, else its name) ready when its backward time has passed,
    layers last to first after the forward time; its fit if it has one."""
    import json

    from ..errors import ConfigError
    from .buckets import load_profile
    try:
        with open(path) as f:
            data = json.load(f)
        forward, layers = load_profile(data)
        fit = Fit.from_dict(data["allreduce"]) if data.get("allreduce") else None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"buckets.profile {path!r} is not a readable profile: {e}") from e
    ready, t = {}, forward
    for layer, raw in zip(reversed(layers), reversed(data["layers"])):
        t += layer.backward_time
        for var in raw.get("variables") or [layer.name]:
            ready[var] = t
    return Profile(1, {}, ready, forward, fit)


def measure(tg, run_metadata, indices: dict) -> Profile:
    """One step's Profile from its RunMetadata and replica 0's gradient
    indices of the sparse variables ({var: array}; for a dense variable
    whose gradient is a product, its first factor: analysis.unknown_rows)."""
    start, end_of = None, {}
    for dev in run_metadata.step_stats.dev_stats:
        for ns in dev.node_stats:
            t0 = ns.all_start_micros
            t1 = t0 + (ns.all_end_rel_micros or ns.op_end_rel_micros)
            start = t0 if start is None else min(start, t0)
            end_of[ns.node_name] = max(end_of.get(ns.node_name, 0), t1)
    if start is None:
        raise ValueError("the run was not traced: its RunMetadata has no step stats")

    done = _done_times(tg, end_of)

    def seconds(node):        # when `node`'s value was there, from the step's start
        t = done(node)
        return None if t is None else (t - start) / 1e6

    ready = {}
    for var, grad in tg.gradients.items():
        ends = [t for r in (grad.values, grad.indices) if r is not None
                for t in [seconds(r.node)] if t is not None]
        if ends:
            ready[var] = max(ends)
    rows = {var: float(len(np.unique(idx))) for var, idx in indices.items()
            if tg.gradients[var].sparse}
    factor_rows = {var: int(np.shape(a)[0]) for var, a in indices.items()
                   if not tg.gradients[var].sparse}
    forward = seconds(_loss(tg)) or 0.0
    return Profile(1, rows, ready, forward, factor_rows=factor_rows)


def _done_times(tg, end_of: dict):
    """A function: node -> when its value was there (microseconds). An op
    graph optimisation removed (an Identity, a no-op Reshape) is absent from
    the step stats: its value was there when the latest of its inputs was.
    None for a node nothing in the step stats leads to. A while loop's back
    edge (NextIteration to Merge) is not followed: a loop's values are there
    when what enters it is (the walk went round the loop for good)."""
    memo: dict[str, float | None] = {}

    def inputs(name: str) -> list[str]:
        out = [r.node for r in tg.ir.data_inputs(name)]
        if tg.ir.node(name).op in ("Merge", "RefMerge"):
            out = [i for i in out if tg.ir.get(i) is None or
                   tg.ir.node(i).op not in ("NextIteration", "RefNextIteration")]
        return out

    def done(node: str):
        todo = [node]
        while todo:
            name = todo[-1]
            if name in memo:
                todo.pop()
                continue
            if name in end_of or tg.ir.get(name) is None:
                memo[name] = end_of.get(name)
                todo.pop()
                continue
            missing = [i for i in inputs(name) if i not in memo]
            if missing:
                todo.extend(missing)
                continue
            times = [memo[i] for i in inputs(name) if memo[i] is not None]
            memo[name] = max(times) if times else None
            todo.pop()
        return memo[node]

    return done


def _loss(tg) -> str | None:
    """The forward op the backward pass starts from: of the forward tensors
    the autodiff reads, the one deepest in the forward pass."""
    depth = forward_depths(tg)
    read = {r.node for n in tg.ir.nodes if rules.is_autodiff(n.name)
            for r in tg.ir.data_inputs(n.name) if not rules.is_autodiff(r.node)}
    return max(read, key=lambda n: (depth.get(n, -1), n), default=None)


def first_step_profile(tg, timeout_seconds: float, steps: int = 1, feeds: dict | None = None,
                       replicas: int = 1) -> tuple[Profile | None, str]:
    """(profile, why not measured): when each trained variable's gradient
    became ready, the forward time and the distinct rows of sparse
    gradients, over `steps` traced steps (after one untraced; the times
    scaled by how much longer a traced step took than an untraced one) of
    the user's own graph, run
    in a session of its own on this process (its variables initialized, its
    iterators made, the gradients fetched; nothing is applied and nothing of
    a job's state is touched). Empty, with the reason, when that step would
    need feeds or queue input, or when it fails: None with the reason.
    `feeds`: placeholder tensor name -> one replica's value (a TF2 step's
    first batch, parallax_ng/tf2.py), fed to every run. `touched`: which
    rows TOUCH_STEPS steps of a worker of `replicas` replicas touch, each
    step the union of that many runs of the sparse gradients' indices
    alone (untraced)."""
    import statistics
    import time

    import tensorflow as tf

    from ..graph.rules import READ_PREFIXES

    heads = sorted({r.node for r in tg.gradient_tensors})
    ancestors = tg.ir.ancestors(heads)
    feeds = dict(feeds or {})
    fed = sorted(a for a in ancestors if tg.ir.node(a).op in ("Placeholder", "PlaceholderV2")
                 and a + ":0" not in feeds)
    if fed:
        return None, f"the gradients need fed placeholders ({', '.join(fed[:3])})"
    if any(tg.ir.node(a).op.startswith(READ_PREFIXES) for a in ancestors):
        return None, "the gradients read an input queue"
    graph = tg.graph
    inits = [v.initializer for v in tg.variables.values() if v.initializer]
    inits += [op.name for op in graph.get_operations() if op.type == "MakeIterator"]
    inits += [op.name for op in graph.get_collection(tf.compat.v1.GraphKeys.TABLE_INITIALIZERS)]
    fetches = sorted({f"{r.node}:{r.index}" for r in tg.gradient_tensors})
    probe = {v: f"{g.indices.node}:{g.indices.index}" for v, g in sorted(tg.gradients.items())
             if g.sparse and g.indices is not None}
    probe.update(unknown_rows(tg, analyze(tg)))
    options = tf.compat.v1.RunOptions(trace_level=compat.trace_level(),
                                      timeout_in_ms=int(timeout_seconds * 1000))
    config = tf.compat.v1.ConfigProto(allow_soft_placement=True)
    profile = None
    plain = tf.compat.v1.RunOptions(timeout_in_ms=options.timeout_in_ms)
    walls = {"plain": [], "traced": []}

    def timed(kind, *args, **kwargs):
        start = time.perf_counter()
        out = session.run(*args, **kwargs)
        walls[kind].append(time.perf_counter() - start)
        return out
    try:
        with tf.compat.v1.Session(graph=graph, config=config) as session:
            session.run(inits, feeds)
            session.run(fetches, feeds, options=plain)   # warm-up: kernels, caches
            for _ in range(steps):
                timed("plain", fetches, feeds, options=plain)
                metadata = tf.compat.v1.RunMetadata()
                got = timed("traced", [fetches, list(probe.values())], feeds, options=options,
                            run_metadata=metadata)
                step = measure(tg, metadata, dict(zip(probe, got[1])))
                profile = step if profile is None else profile.merge(step)
            sparse = [v for v in probe if tg.gradients[v].sparse]
            steps_rows = {v: [] for v in sparse}
            for _ in range(TOUCH_STEPS if sparse else 0):
                runs = [session.run([probe[v] for v in sparse], feeds, options=plain)
                        for _ in range(replicas)]
                for k, v in enumerate(sparse):
                    steps_rows[v].append(np.unique(np.concatenate([r[k] for r in runs])))
            profile = replace(profile, touched={v: sample(np.concatenate(parts))
                                                for v, parts in steps_rows.items()})
        # tracing slows every op: times as a step without it would take
        profile = profile.scaled(min(1.0, statistics.median(walls["plain"]) /
                                     statistics.median(walls["traced"])))
    except (tf.errors.OpError, ValueError, TypeError) as e:
        return None, f"its step failed ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
    return profile, ""
