"""The all-reduce cost a + b*M, measured on the job's own devices and fitted.

A micro-benchmark all-reduces float32 tensors of 4 KB, 16 KB, ... (times 4)
up to 64 MB, or up to the model's gradient bytes when those are fewer (at
least four sizes), over exactly the devices and group size the training
all-reduces use, each size a warm-up run and then `repeats` traced runs. A
run's time is from when the last local replica's all-reduce started (its
input was there) to when the last one finished, from the step stats, so
making the input is not counted; the size's time is the median. The fit
is least squares with relative residuals (each point weighted by 1/t, so a
4 KB message counts as much as a 64 MB one), a >= 0; its error is the
root-mean-square and the largest relative residual.

In a job every worker runs the same sizes in the same order (the all-reduce
needs all of them); worker 0's fit is given to the others with the
measured profile, so every worker plans the same buckets.

Requires: a session target and config that reach the devices (in-process:
"" and the runner's ConfigProto; a job: the worker's server).
Guarantees: `Fit` with a, b >= 0; None for fewer than two replicas.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

from .. import compat
from ..comm.collectives import OP_TIMEOUT_SECONDS
from ..comm.keys import BENCHMARK_GROUP
from ..methods import method
from .buckets import Cost

MIN_BYTES, MAX_BYTES = 4 * 1024, 64 * 2**20
CHAINED = 10                     # products a run of the MatMul benchmark makes in turn
FIRST_INSTANCE_KEY = 1 << 29     # above the graph's single keys, below its ranges


@dataclass(frozen=True)
class Fit:
    a: float
    b: float
    points: tuple[tuple[int, float], ...]     # (bytes, seconds) measured

    @property
    def cost(self) -> Cost:
        return Cost(self.a, self.b)

    def residuals(self) -> list[float]:
        return [(self.cost(m) - t) / t for m, t in self.points]

    def link_b(self) -> float:
        """Seconds per byte of large messages: the slope between the two
        largest sizes when the largest is 1 MB or more (the fit weighs
        every size alike, and small messages pull b down), else b."""
        big = sorted(self.points)[-2:]
        if len(big) == 2 and big[1][0] >= 2**20 and big[1][1] > big[0][1]:
            return (big[1][1] - big[0][1]) / (big[1][0] - big[0][0])
        return self.b

    @property
    def rms_error(self) -> float:
        r = self.residuals()
        return float(np.sqrt(np.mean(np.square(r)))) if r else 0.0

    @property
    def max_error(self) -> float:
        return max((abs(r) for r in self.residuals()), default=0.0)

    def to_dict(self) -> dict:
        return {"a": self.a, "b": self.b, "rms_relative_error": self.rms_error,
                "max_relative_error": self.max_error,
                "points": [{"bytes": m, "seconds": t} for m, t in self.points]}

    @classmethod
    def from_dict(cls, data: dict) -> "Fit":
        return cls(float(data["a"]), float(data["b"]),
                   tuple((int(p["bytes"]), float(p["seconds"]))
                         for p in data.get("points", ())))

    def format(self) -> str:
        rows = [f"all-reduce cost a + b*M: a = {self.a * 1e6:.1f} us, "
                f"b = {self.b * 1e9:.4f} ns/byte ({1 / self.b / 1e9 if self.b else 0:.2f} GB/s); "
                f"fit error: rms {self.rms_error:.1%}, largest {self.max_error:.1%}",
                f"{'bytes':>12} {'measured ms':>12} {'fit ms':>9}"]
        rows += [f"{m:12d} {t * 1e3:12.3f} {self.cost(m) * 1e3:9.3f}" for m, t in self.points]
        return "\n".join(rows)


def fit(points) -> Fit:
    """Least squares of t = a + b*M with relative residuals, a >= 0."""
    points = tuple((int(m), float(t)) for m, t in points)
    if len(points) < 2:
        raise ValueError(f"a fit of a + b*M needs two sizes or more, not {len(points)}")
    m = np.array([p[0] for p in points], dtype=float)
    t = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / t
    (a, b), *_ = np.linalg.lstsq(np.stack([w, m * w], axis=1), np.ones_like(t), rcond=None)
    if a < 0:        # through the origin
        a, b = 0.0, float(np.sum(m * t * w * w) / np.sum(m * m * w * w))
    return Fit(float(a), max(float(b), 0.0), points)


def model_bytes(tg, plan) -> int:
    """The bytes the plan all-reduces per replica, else all the variables'
    (what the benchmark's largest size should reach)."""
    return sum(tg.variables[v].nbytes for v, vp in plan.variables.items()
               if method(vp.method).all_reduced) or sum(v.nbytes for v in tg.variables.values())


def sizes(total_bytes: int) -> list[int]:
    """4 KB, 16 KB, ... up to 64 MB, or to the first size >= total_bytes,
    at least four sizes."""
    out = [MIN_BYTES]
    while out[-1] < MAX_BYTES and (out[-1] < total_bytes or len(out) < 4):
        out.append(out[-1] * 4)
    return out


def measure(target: str, devices: list[str], group_size: int, nbytes: list[int],
            session_config, timeout_seconds: float, repeats: int = 5) -> Fit | None:
    """The fit from all-reducing each of `nbytes` over `devices` (this
    process's replicas) in a group of `group_size` replicas."""
    import tensorflow as tf
    if group_size < 2:
        return None
    graph = tf.Graph()
    runs = []
    with graph.as_default(), tf.compat.v1.name_scope("parallax/allreduce_benchmark"):
        for k, size in enumerate(nbytes):
            ops = []
            for device in devices:
                with tf.device(device):
                    x = tf.fill([size // 4], tf.constant(1.0))
                    ops.append(tf.raw_ops.CollectiveReduce(
                        input=x, group_size=group_size, group_key=BENCHMARK_GROUP,
                        instance_key=FIRST_INSTANCE_KEY + k, merge_op="Add", final_op="Id",
                        subdiv_offsets=[0], wait_for=[], communication_hint="auto",
                        timeout_seconds=OP_TIMEOUT_SECONDS).op)
            runs.append(ops)
    options = tf.compat.v1.RunOptions(trace_level=compat.trace_level(target),
                                      timeout_in_ms=int(timeout_seconds * 1000))
    points = []
    with tf.compat.v1.Session(target, graph=graph, config=session_config) as session:
        for size, ops in zip(nbytes, runs):
            session.run(ops, options=options)          # warm-up: the group is resolved
            times = []
            for _ in range(repeats):
                metadata = tf.compat.v1.RunMetadata()
                session.run(ops, options=options, run_metadata=metadata)
                times.append(_collective_time(metadata, {op.name for op in ops}))
            points.append((size, statistics.median(times)))
    return fit(points)


def _collective_time(metadata, names: set) -> float:
    """Seconds from the last start to the last end of the nodes `names`."""
    starts, ends = [], []
    for dev in metadata.step_stats.dev_stats:
        for ns in dev.node_stats:
            if ns.node_name in names:
                starts.append(ns.all_start_micros)
                ends.append(ns.all_start_micros + (ns.all_end_rel_micros or ns.op_end_rel_micros))
    if not starts:
        raise ValueError("the benchmark's all-reduces are missing from the step stats")
    return max(1, max(ends) - max(starts)) / 1e6


def round_trip(target: str, server: str, host: str, session_config, timeout_seconds: float,
               repeats: int = 30) -> tuple[float, float]:
    """(seconds a round trip to `server` adds to a session run, seconds of
    a session run of one op on `host`, this worker's CPU): the fixed costs
    of a step's round trip to a parameter server and of a session run of
    its own, every worker measuring at once as in training. Medians of
    `repeats` runs of each after five; the round trip is a run that updates
    a scalar on the server and reads it back, less the local run."""
    import time

    import tensorflow as tf
    graph = tf.Graph()
    task = host.split("/task:")[1].split("/")[0]
    with graph.as_default(), tf.compat.v1.name_scope("parallax/round_trip"):
        with tf.device(server):
            var = tf.compat.v1.get_variable(f"parallax/round_trip/worker_{task}", [],
                                            initializer=tf.compat.v1.zeros_initializer(),
                                            use_resource=True)
            bumped = var.assign_add(1.0)
        with tf.device(host):
            back = tf.identity(bumped)
            local = tf.identity(tf.constant(1.0)) + 1.0
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_seconds * 1000))
    times: dict = {back: [], local: []}
    with tf.compat.v1.Session(target, graph=graph, config=session_config) as session:
        session.run(var.initializer, options=options)
        for k in range(repeats + 5):
            for fetch in (back, local):     # alternating: a drift hits both
                start = time.perf_counter()
                session.run(fetch, options=options)
                if k >= 5:
                    times[fetch].append(time.perf_counter() - start)
    run = statistics.median(times[local])
    return max(0.0, statistics.median(times[back]) - run), run


def matmul_rate(info: dict, replicas: int, repeats: int = 7) -> float | None:
    """Floating-point operations per second of the product method factors
    makes (MatMul(a, b, transpose_a=True) of `replicas` replicas' factors),
    at the size of the largest dense variable whose gradient is a product
    (`info`: the analysis; rows unknown yet: 128 a replica), in a session of
    this process: the median of `repeats` runs after two, each of CHAINED
    products one after another (so a session run's own cost, which a step
    pays once, is shared). None when no
    variable's gradient is a product."""
    import time

    import tensorflow as tf
    sizes = [(vi.factors[0] or 128, vi.shape[0], vi.shape[1]) for vi in info.values()
             if vi.factors and len(vi.shape) == 2 and None not in vi.shape]
    if not sizes:
        return None
    rows, left, right = max(sizes, key=lambda s: (s[1] * s[2], s))
    rows *= max(replicas, 1)
    graph = tf.Graph()
    with graph.as_default(), tf.compat.v1.name_scope("parallax/matmul_benchmark"):
        a = tf.Variable(tf.ones([rows, left]))
        b = tf.Variable(tf.ones([rows, right]))
        product = tf.no_op()
        for _ in range(CHAINED):       # one after another, as in a step: a run's cost shared
            with tf.control_dependencies([product]):
                product = tf.linalg.matmul(a, b, transpose_a=True).op
    times = []
    config = tf.compat.v1.ConfigProto()      # no grappler: it would merge the alike products
    config.graph_options.rewrite_options.disable_meta_optimizer = True
    with tf.compat.v1.Session(graph=graph, config=config) as session:
        session.run([a.initializer, b.initializer])
        for k in range(repeats + 2):
            start = time.perf_counter()
            session.run(product)
            if k >= 2:
                times.append(time.perf_counter() - start)
    return 2.0 * rows * left * right * CHAINED / max(statistics.median(times), 1e-9)
