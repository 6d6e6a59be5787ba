"""Packing: which gradients travel together, in the order they become ready.

- `fusion_buffers`: the gradients of the variables aggregated by balanced
  fusion buffers (method bfb, mirrored), packed flat in the order they
  become ready into equal buffers, each buffer sharded evenly over the
  servers (Herring III-1, III-2);
- `allreduce_buckets`: the all-reduced gradients merged into buckets as
  `buckets.mode` says (parallax_ng/planning/buckets.py: one, by a byte
  threshold, or MG-WFBP's merges from measured ready times).

Gradients of different `stages` never travel together: a step that
updates some variables and then computes other gradients from their new
values (a GAN's train_step: the discriminator's update, then the
generator's gradient through the updated discriminator) aggregates the
first before the second exists. Nor do gradients of different `runs`:
those a script's separate train ops apply (a TF1 GAN's two `minimize`
ops, run in turn); one exchange of both would make either train op
compute the other's gradient too, reading the other's batch from its
iterator and running what that gradient waits for (its batch
normalization's moving averages).

Requires: a TrainingGraph and the order its gradients become ready
(`ready_order`: measured, else the graph's). Guarantees: the same inputs
give the same packing on every worker.
"""
from __future__ import annotations

from ..errors import ConfigError
from ..graph import rules
from ..graph.frontend import TrainingGraph
from . import buckets as bucketing
from .buckets import fusion_buffer_size
from .placement import Sharded
from .plan import Bucket, Buffer, Segment


def ready_order(tg: TrainingGraph, variables: list[str], measured=()) -> list[str]:
    """`variables` in the order their gradients become ready: as measured,
    else the order of their gradient ops in the graph's topological order
    (the same on every worker); variables the measurement missed go last."""
    index = tg.ir.topo_index
    static = sorted(variables, key=lambda v: (index[tg.gradients[v].values.node], v))
    seen = [v for v in measured if v in set(variables)]
    return seen + [v for v in static if v not in set(seen)]


def stages(tg: TrainingGraph) -> dict[str, int]:
    """Each gradient's stage: 0 for a gradient computed from no other
    gradient, else one more than the highest stage among the gradients it
    is computed from (through data or control edges: through their
    aggregation and the updates that read it, once the step is rewritten).
    The autodiff's own reads of a gradient tensor (the backward pass going
    on from it: tf.nn.batch_normalization's offset gradient is also the
    mean's, negated, in a GradientTape) keep the replica's own value
    (transforms/aggregate.py), so they do not raise the stage."""
    owners: dict[str, list[str]] = {}
    for var, g in tg.gradients.items():
        for ref in (g.values, g.indices):
            if ref is not None:
                owners.setdefault(ref.node, []).append(var)
    level: dict[str, int] = {}      # the stage an op's value waits for
    local: dict[str, int] = {}      # the same, for a gradient's own value
    out: dict[str, int] = {}
    for name in tg.ir.topo_order:
        node = tg.ir.node(name)
        backward = rules.is_autodiff_use(node)
        here = max(((local if backward and src in owners else level).get(src, 0)
                    for src, _, _ in tg.ir.parsed_inputs(node)), default=0)
        for var in owners.get(name, ()):
            out[var] = max(out.get(var, 0), here)
        local[name] = here
        level[name] = max([out[v] + 1 for v in owners.get(name, ())], default=here)
    return out


def runs(tg: TrainingGraph) -> dict[str, int]:
    """Each trained variable's run, numbered alike on every worker:
    variables whose gradients reach a common end of the graph (an op
    nothing reads, as the train op a script fetches is) past a write of a
    variable (an update: not a fetch of a gradient's norm) share one; a
    GAN's two train ops make two."""
    grads = {v: g.values.node for v, g in tg.gradients.items()}
    below = tg.ir.descendants(set(grads.values()))
    trains = tg.ir.descendants({w for ws in tg.writers.values() for w in ws if w in below})
    ends = tg.ir.ends(set(grads.values()), keep=trains.__contains__)
    joined = {v: v for v in grads}

    def root(v):
        while joined[v] != v:
            v = joined[v]
        return v
    first: dict[str, str] = {}
    for v in sorted(grads):
        for end in ends[grads[v]] or {""}:     # (no update below: one run of their own)
            joined[root(v)] = root(first.setdefault(end, v))
    number: dict[str, int] = {}
    return {v: number.setdefault(root(v), len(number)) for v in sorted(grads)}


def reached_runs(tg: TrainingGraph, run: dict[str, int]) -> dict[str, frozenset[int]]:
    """The `runs` whose gradients each op reads, directly or through others
    (data or control edges; ops that read none are left out): what a
    train op's update waits for is its own run's."""
    seeds: dict[str, set] = {}
    for v, g in tg.gradients.items():
        seeds.setdefault(g.values.node, set()).add(run[v])
    out: dict[str, frozenset[int]] = {}
    for name in tg.ir.topo_order:
        found = set(seeds.get(name, ())).union(*(out.get(src, ()) for src, _, _ in
                                                 tg.ir.parsed_inputs(tg.ir.node(name))))
        if found:
            out[name] = frozenset(found)
    return out


def check_stages(stage: dict[str, int], shared: list[str], num_workers: int) -> None:
    """Refuses variables kept once on parameter servers (`shared`) in a job
    of several workers whose step computes gradients from variables it
    updated earlier in the step (`stage`: `stages`): each worker pushes its
    gradients once per server and step, after its every read of the
    servers' variables."""
    stage = stage if shared and num_workers > 1 else {}
    later = sorted(v for v, s in stage.items() if s > 0)
    if later:
        raise ConfigError(
            f"the step computes the gradients of {later[:4]} from variables it updated "
            f"earlier in the same step (those of {sorted(set(stage) - set(later))[:4]}; a "
            f"GAN's train_step does), and the plan keeps {shared[:4]} on parameter servers, "
            "which a job of several workers updates once per step; use run_option "
            "allreduce, or hybrid with dense_method bfb or allreduce")


def allreduce_buckets(tg: TrainingGraph, order: list[str], config, profile=None,
                      stage: dict | None = None, run: dict | None = None
                      ) -> tuple[Bucket, ...]:
    """The all-reduced variables in `order` (backward) merged into buckets
    as `config.mode` says (parallax_ng/planning/buckets.py), one dtype and one stage per bucket
    (auto: by `config.bytes` until parallax_ng/runtime/tuning.py tries others);
    none for mode `none` (one all-reduce per variable). mgwfbp takes each
    variable's backward time from `profile` (the time since the variable
    before it was ready; without one every gradient is ready at once) and
    the all-reduce cost from the config, else from the profile's fit (none
    yet: one all-reduce per variable until it is measured). The file
    `buckets.profile` names, read, comes as `profile` (parallax_ng/build.py);
    one `runs` per bucket too."""
    cost = (bucketing.Cost(config.a, config.b) if config.a is not None else
            profile.allreduce.cost if profile is not None and profile.allreduce else None)
    if config.mode == "none" or (config.mode == "mgwfbp" and cost is None):
        return ()
    ready = profile.ready if profile is not None else {}
    start = profile.forward_time if profile is not None else 0.0
    out, stage, run = [], stages(tg) if stage is None else stage, runs(tg) if run is None else run
    kind = {v: (stage.get(v, 0), run[v], tg.variables[v].dtype.base_dtype.name) for v in order}
    for group in sorted(set(kind.values())):
        same = [v for v in order if kind[v] == group]
        times, previous = [], start
        for v in same:
            at = max(ready.get(v, previous), previous)
            times.append(at - previous)
            previous = at
        layers = [bucketing.Layer(v, tg.variables[v].nbytes, t)
                  for v, t in zip(reversed(same), reversed(times))]
        if config.mode == "single":
            chosen = bucketing.single(layers)
        elif config.mode in ("threshold", "auto"):    # auto: until tuning tries others
            chosen = bucketing.threshold(layers, config.bytes)
        else:
            chosen = bucketing.mgwfbp(start, layers, cost)
        out += [Bucket(tuple(same[i] for i in b)) for b in chosen]
    return tuple(out)


def fusion_buffers(tg: TrainingGraph, order: list[str], servers: list[str],
                   size_bytes: int = 0, stage: dict | None = None,
                   run: dict | None = None) -> tuple[Buffer, ...]:
    """Gradients of `order` packed flat, in that order, into buffers of
    `size_bytes` (0: `fusion_buffer_size`), one dtype per run of buffers; a
    variable may span two buffers, the last buffer may be smaller; gradients
    of different `stages` or `runs` in buffers of their own. Every buffer
    is sharded evenly over `servers` at element offsets."""
    by_kind: dict = {}
    stage, run = stages(tg) if stage is None else stage, runs(tg) if run is None else run
    for var in order:
        by_kind.setdefault((stage.get(var, 0), run[var], tg.variables[var].dtype),
                           []).append(var)
    out = []
    for (*_, dtype), variables in sorted(by_kind.items(), key=lambda kv: kv[0][:2]):
        sizes = {v: tg.variables[v].nbytes // dtype.size for v in variables}
        total = sum(sizes.values())
        per = max(1, (size_bytes or fusion_buffer_size(total * dtype.size, len(servers)))
                  // dtype.size)
        segments, used = [], 0
        for var in variables:
            start = 0
            while start < sizes[var]:
                take = min(sizes[var] - start, per - used)
                segments.append(Segment(var, start, take, used))
                start, used = start + take, used + take
                if used == per:
                    out.append(_buffer(segments, used, servers))
                    segments, used = [], 0
        if segments:
            out.append(_buffer(segments, used, servers))
    return tuple(out)


def _buffer(segments: list[Segment], length: int, servers: list[str]) -> Buffer:
    return Buffer(tuple(segments), Sharded.even(None, length, servers))
