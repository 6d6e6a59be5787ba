"""Planner: the transformation's decisions, in three separate steps.

1. policy, `choose_methods`: an aggregation method per trained variable,
   from the run option, per-variable overrides and the analysis;
2. placement, `shared_roots`: which trained variables exist once (method
   ps); everything a variable owns (slots, moving averages) goes with it;
3. device map, `map_devices`: a Placement for every variable: mirrored;
   shared on the host in-process; in a job spread over the servers by
   bytes (`balance`, greedy; or `round_robin`), a large sparse variable cut
   into row ranges; a variable aggregated by AlltoAll (method alltoall) and
   its slots cut by columns over every replica of the job (`by_columns`,
   EmbRace 4.1); and the packing of gradients (planning/packing.py).

`make_plan` composes them with the random streams, input producers, the
step schedule and batch normalization's exchanges. Requires: a
TrainingGraph, its analysis, a Config and the devices. Guarantees: the
same inputs give the same plan on every worker."""
from __future__ import annotations

from dataclasses import replace

from ..config import Config
from ..errors import ConfigError
from ..graph import averaging, queues, randomness, rules
from ..graph.frontend import TrainingGraph
from ..methods import METHODS, method
from . import choice, costmodel, deferral, traffic
from .analysis import VariableInfo
from .facts import Facts
from .packing import allreduce_buckets, check_stages, fusion_buffers, ready_order
from .placement import MIRRORED, Columns, Sharded, Shared
from .plan import Plan, Rewrites, Schedule, VariablePlan, job_devices


def make_plan(tg: TrainingGraph, info: dict[str, VariableInfo], config: Config,
              devices: list[str], host: str, num_workers: int = 1, worker: int = 0,
              servers: list[str] = (), order: tuple[str, ...] = (), profile=None,
              layout: traffic.Layout | None = None, bucket_profile=None,
              facts: Facts | None = None) -> Plan:
    """`order`: trained variables in the order their gradients became ready
    in a measured step (in a job the one worker 0 measured and gave every
    worker: build.py `measure_job`); empty: the static order. `profile`: a
    measured step (planning/profile.py), whose ready times the mgwfbp buckets
    use; `bucket_profile`: the file `buckets.profile` names, read, which
    stands for it there. `facts`: the graph's shared analyses (made where
    not given). `layout`: the hosts of a job's tasks, whose links weigh
    hybrid's and auto's plans (choice.py); None: all on this one."""
    dense, sparse, note = averaging.averages(config, tg.graph, sites := [])  # (scaled sums)
    config = replace(config, average_dense=dense, average_sparse=sparse)
    facts = facts or Facts(tg)
    lines, norms = facts.normalization(config.batch_norm) \
        if len(devices) * num_workers > 1 else ((), ())
    notes = (note,) * bool(note) + lines
    if config.run_option == "hybrid" and num_workers > 1 and not servers and \
            config.sparse_method == "auto" and \
            not any(method(m).shared for m in config.variable_methods.values()) \
            and any(vi.sparse for vi in info.values()):
        config = replace(config, sparse_method="allgather")
        notes += ("run_option hybrid: the job has no parameter server (`ps:` in the resource "
                  "file), so sparse gradients go by all-gather, as under run_option allreduce",)
    job_servers = num_workers > 1 and bool(servers) and config.communication.backend == "tf"
    backend = config.communication.backend
    can_cut = lambda v: cuttable(facts, v, len(devices), num_workers, backend)   # noqa: E731
    can_sum = lambda v: facts.coalescing(v) is not None or v in tg.rows_unique   # noqa: E731
    group = len(devices) * num_workers
    weighing = choice.weighs(config, num_workers, servers, info)
    net, costs = None, {}
    if config.run_option == "auto" or weighing:
        layout = layout or traffic.Layout.local(num_workers, len(servers))
        net = network(config, profile, group, layout)
    if config.run_option == "auto":
        costs = {name: costmodel.costs(vi, allowed_methods(vi, name, job_servers, can_cut,
                                                           can_sum),
                                       group, len(servers), net)
                 for name, vi in info.items()}
    job = (facts, info, devices, host, num_workers, worker, servers, order,
           bucket_profile or profile)

    def build(cfg: Config, tables: dict) -> Plan:
        methods = choose_methods(info, cfg, job_servers, can_cut, can_sum, tables)
        return replace(_plan_of(job, cfg, methods), costs=costs, norm_points=norms,
                       network=net.describe() if net else "", notes=notes,
                       scaled_sums=tuple(sites) if group > 1 else ())
    if not weighing:
        return build(config, costs)
    candidates, refused = [], []
    for label, cfg, tables in choice.options(config, costs, info, net, group, len(servers)):
        try:
            candidates.append((label, build(cfg, tables)))
        except ConfigError as e:
            refused.append(e)
    if not candidates:
        raise refused[0]
    index_bytes = {v: tg.tensor(g.indices).dtype.size for v, g in tg.gradients.items()
                   if g.sparse and g.indices is not None}
    return choice.best(candidates, layout, net, index_bytes)


def _plan_of(job: tuple, config: Config, methods: dict[str, str]) -> Plan:
    """The plan of a job (`make_plan`'s inputs) with these methods."""
    facts, info, devices, host, num_workers, worker, servers, order, profile = job
    tg = facts.tg
    variables = {name: VariablePlan(name, how, info[name],
                                    coalesce=config.coalesce_rows and
                                    method(how).coalesces and name not in tg.rows_alike and
                                    name not in tg.rows_unique and
                                    facts.coalescing(name) is not None,
                                    unique_rows=name in tg.rows_unique,
                                    note=_unmet(facts, config, name, how, devices,
                                                num_workers))
                 for name, how in methods.items()}
    roots = shared_roots(variables)
    fused = sorted(v for v, vp in variables.items() if method(vp.method).fused)
    split = num_workers > 1 and bool(roots or fused)
    variables = {name: deferral.prefetch(facts, vp, config, split)
                 for name, vp in variables.items()}
    _check_servers(tg, roots + fused, config, num_workers, servers)
    check_stages(facts.stages(), roots, num_workers)
    by_rows = config.ps_placement == "rows_touched"
    placement = map_devices(tg, roots, host, servers if num_workers > 1 or servers else (),
                            config.ps_placement, {v: i.touched for v, i in info.items()}
                            if by_rows else None)
    variables.update({v: variables[v].noted("ps_placement rows_touched: even row ranges, no "
                      "step measured") for v, p in placement.items() if by_rows and
                      v in variables and isinstance(p, Sharded) and not info[v].touched})
    placement.update(by_columns(facts, [v for v, vp in variables.items()
                                     if method(vp.method).columns],
                                job_devices(devices, num_workers, worker), num_workers,
                                config.communication.backend))
    size = config.fusion.buffer_bytes       # auto: the default until tuning tries others
    buffers = fusion_buffers(tg, ready_order(tg, fused, order), list(servers) or [host],
                             0 if size == "auto" else size, facts.stages(), facts.runs())
    blocks, notes = deferral.horizontal_blocks(facts, variables, config, split)
    variables.update({v: variables[v].noted(note) for v, note in notes.items()})
    later = {v for b in blocks for v in b}
    reduced = [v for v, vp in variables.items() if v not in later and   # dense, known size
               method(vp.method).all_reduced and not vp.info.sparse and vp.info.known]
    timed = order if config.buckets.mode == "mgwfbp" else ()   # else the graph's, as a job's
    buckets = allreduce_buckets(tg, ready_order(tg, reduced, timed), config.buckets, profile,
                                facts.stages(), facts.runs())
    producers = [q for q in queues.find(tg) if q.producer]
    drawn = {**randomness.random_ops(tg.ir.nodes, tg.ir.library),
             **dict.fromkeys(randomness.stateless_draws(tg.ir, tg.variant))}
    pinned = {op for q in producers for op in q.random}
    random = randomness.decide(drawn, config.random, config.random_ops, pinned=pinned,
                               batch_free=randomness.batch_free(tg, drawn))
    return Plan(config.run_option, config.average_dense, config.average_sparse,
                tuple(devices), host, variables, placement,
                timeout_seconds=config.communication.timeout_seconds,
                num_workers=num_workers, worker=worker, servers=tuple(servers),
                backend=config.communication.backend, random=random,
                compression=config.communication.compression,
                counted=tuple(randomness.counted(tg, random, pinned)),
                split_queues={q.queue: q.enqueues for q in producers},
                schedule=Schedule(split=split), buffers=buffers, buckets=buckets,
                blocks=blocks,
                distinct_lookups=config.distinct_lookups and (
                    bool(servers) or any(method(vp.method).columns
                                         for vp in variables.values())),
                rewrites=Rewrites(**vars(config.placement_rewrites)))


def _unmet(facts, config: Config, name: str, how: str, devices, num_workers: int) -> str:
    """Why a sparse variable does not go by the config's `sparse_method`
    (one that cuts tables by columns, or sums rows as dense), or a dense
    one by `dense_method: factors`, or ""."""
    if config.dense_method == "factors" and how != "factors" and \
            not facts.tg.gradients[name].sparse and name not in config.variable_methods:
        return (f"dense_method factors not used (its gradient is not MatMul(a, b, "
                f"transpose_a=True) of two 2-D tensors); it goes by {how}")
    asked = config.sparse_method
    wanted = METHODS.get(asked)
    if wanted is None or not (wanted.columns or wanted.sums_rows) or how == asked or \
            not facts.tg.gradients[name].sparse or name in config.variable_methods:
        return ""
    if wanted.columns:
        try:
            by_columns(facts, [name], [""] * (len(devices) * num_workers), num_workers,
                       config.communication.backend)
            why = "the cost model chose otherwise"
        except ConfigError as e:
            why = str(e)
    else:
        why = ("a use of its rows sees them one by one, so duplicate rows may not be "
               "summed" if facts.coalescing(name) is None and name not in facts.tg.rows_unique
               else "the cost model chose otherwise")
    return f"sparse_method {asked} not used ({why}); it goes by {how}"


# -- 1. policy -----------------------------------------------------------------
def choose_methods(info: dict[str, VariableInfo], config: Config,
                   job_servers: bool = False, cuttable=lambda v: True,
                   can_sum_rows=lambda v: True, costs=None) -> dict[str, str]:
    """`job_servers`: a job of several workers with parameter servers.
    `cuttable(var)`: whether alltoall can cut a sparse variable by columns;
    `can_sum_rows(var)`: whether a sparse gradient may be all-reduced as a
    dense one (duplicate rows summed: coalescing.py). `sparse_method:
    alltoall` (or allreduce) takes the run option's method for a variable
    that cannot (a 1-D bias cannot be cut by columns), as `dense_method:
    factors` does for a gradient not a product of two factors; naming it in
    `variable_methods` is an error. `costs` (run_option auto): each
    variable's predicted seconds per allowed method; the cheapest wins (a
    dense one takes `dense_method` where the config sets it)."""
    unknown = set(config.variable_methods) - set(info)
    if unknown:
        raise ConfigError(f"config key 'variable_methods' names {sorted(unknown)}, which "
                          f"are not trained variables; trained: {sorted(info)}")
    out = {}
    for name, vi in info.items():
        asked = config.sparse_method if vi.sparse else config.dense_method
        how = config.variable_methods.get(name) or (
            costmodel.choose(costs[name]) if costs and asked == "auto" else
            _default_method(config, vi, job_servers))
        if name not in config.variable_methods and vi.sparse and (
                method(how).columns and not cuttable(name) or
                method(how).sums_rows and not can_sum_rows(name)):
            how = _default_method(replace(config, sparse_method="auto"), vi, job_servers)
        if name not in config.variable_methods and method(how).factored and not vi.factors:
            how = _default_method(replace(config, dense_method="auto"), vi, job_servers)
        if method(how).fused and not vi.known:      # a buffer packs it flat by its size
            if name in config.variable_methods:
                raise ConfigError(f"config key 'variable_methods.{name}' is {how}, which packs "
                                  f"gradients flat by their sizes, but {name}'s shape is not "
                                  "fully defined in the graph; use ps or allreduce")
            how = "ps"
        why = method(how).refusal(name, vi.sparse, can_sum_rows(name) if vi.sparse else True,
                                  bool(vi.factors))
        if why:
            raise ConfigError(why)
        out[name] = how
    return out


def allowed_methods(vi: VariableInfo, name: str, job_servers: bool, can_cut,
                    can_sum) -> tuple[str, ...]:
    """The methods `run_option: auto` weighs for a variable: all-reduce for a
    dense one (and fusion buffers or whole on a job's servers); for a sparse one
    all-gather, alltoall where the table can be cut by columns, all-reduce
    as dense where its rows may be summed, servers in a job that has
    them, and factors for a dense one whose gradient is a product of two
    factors with rows known (from the graph or a measured step: unknown
    rows would look free)."""
    return tuple(m.name for m in METHODS.values()
                 if (m.sparse if vi.sparse else m.dense) and (job_servers or not m.servers)
                 and not (m.factored and not vi.weighable_factors)
                 and not (vi.sparse and m.columns and not can_cut(name))
                 and not (vi.sparse and m.sums_rows and not can_sum(name)))


def network(config: Config, profile, replicas: int, layout: traffic.Layout | None = None
            ) -> costmodel.Network:
    """The network constants: config `network`, else the profile's all-reduce
    fit (with the rate of bytes between tasks of one host where every
    worker of `layout` ran the benchmark on one host), else the defaults;
    with the profile's measured MatMul rate (method factors' product)."""
    flops = profile.flops if profile is not None else None
    if config.network.bandwidth is not None:
        return costmodel.Network(config.network.bandwidth, config.network.latency or 0.0,
                                 "config network", flops=flops)
    if profile is not None and profile.allreduce is not None:
        fit = profile.allreduce
        hosts = {layout.end(traffic.worker(i)) for i in range(len(layout.workers))} \
            if layout is not None else set()
        return replace(costmodel.Network.from_allreduce(
            fit.a, fit.link_b(), replicas, profile.round_trip,
            len(layout.workers) if len(hosts) == 1 else 0, profile.session_run), flops=flops)
    return costmodel.Network(costmodel.BANDWIDTH, costmodel.LATENCY, flops=flops)


def _default_method(config: Config, vi: VariableInfo, job_servers: bool) -> str:
    if vi.sparse and config.sparse_method != "auto":
        return config.sparse_method
    if vi.sparse:
        return "allgather" if config.run_option == "allreduce" else "ps"
    if config.dense_method != "auto":
        return config.dense_method
    return "ps" if config.run_option == "ps" else "allreduce"


# -- 2. placement -----------------------------------------------------------------
def shared_roots(variables: dict[str, VariablePlan]) -> list[str]:
    """Trained variables that exist once (and with them what they own)."""
    return sorted(v for v, vp in variables.items() if vp.shared)


def _check_servers(tg, roots, config, num_workers, servers) -> None:
    """`roots`: trained variables whose aggregation needs parameter servers."""
    if not roots or num_workers == 1 and not servers:
        return
    shared = sorted(roots)
    if config.communication.backend == "horovod" and num_workers > 1:
        raise ConfigError(
            f"the plan aggregates the gradients of {shared[:5]} on parameter servers "
            f"(run_option {config.run_option!r}, dense_method {config.dense_method!r}), which "
            "communication.backend horovod does not have; use run_option: allreduce "
            "(sparse gradients by Horovod's allgather), or backend tf with `ps:` servers")
    if not servers:
        raise ConfigError(
            f"the plan aggregates the gradients of {shared[:5]} on parameter servers "
            f"(run_option {config.run_option!r}, dense_method {config.dense_method!r}), but "
            "the job has none; list `ps: [address]` or `ps: per_host` in the resource "
            "file, or use run_option: allreduce (sparse gradients by AllGather) with "
            "dense_method allreduce")


# -- 3. device map ------------------------------------------------------------------
def map_devices(tg: TrainingGraph, roots: list[str], host: str, servers=(),
                how: str = "greedy", touched: dict | None = None) -> dict:
    """A Placement for every variable: the state of `roots` on the host, or
    over `servers` (`how`: greedy or rows_touched, `balance`; round_robin)."""
    placement = {name: MIRRORED for name in tg.variables}
    if servers and how == "round_robin":
        placement.update(round_robin(tg, roots, list(servers)))
    elif servers:
        sparse = [v for v in roots if v in tg.gradients and tg.gradients[v].sparse]
        placement.update(balance(tg, roots, list(servers), sparse, touched or {}))
    else:
        placement.update({s: Shared(host) for r in roots for s in tg.owned(r)})
    return placement


def cuttable(facts: Facts, var: str, devices: int, num_workers: int,
             backend: str = "tf") -> bool:
    """Whether alltoall can cut sparse variable `var` by columns over a job
    of `num_workers` x `devices` replicas (`by_columns` says why not)."""
    try:
        by_columns(facts, [var], [""] * (devices * num_workers), num_workers, backend)
    except ConfigError:
        return False
    return True


def by_columns(facts: Facts, cut: list[str], devices: list[str],
               num_workers: int = 1, backend: str = "tf") -> dict:
    """Each variable of `cut` and its slots of its shape cut by columns, one
    part per replica of the job (`devices`, in job order); its other state
    (scalars) stays mirrored. Raises ConfigError when a use of the variable
    cannot work on columns (parallax_ng/planning/column_cut.py), and in a job of several
    workers when a step would read the whole of it: that reads other
    workers' parts, and TensorFlow's runtime aborts a step of one worker's
    collectives when another worker's step that touched it ends (DESIGN,
    between-graph facts); a read for the caller alone (a fetch, or, with
    TensorFlow's runtime, a Saver's save: a run of its own that reads the
    other workers' parts without collectives) is fine."""
    tg, out = facts.tg, {}
    alone = {n.name for n in tg.ir.nodes if n.op in rules.EXTERNAL_EFFECT_OPS and
             n.op.startswith("Save")} if backend == "tf" else set()   # a Saver's SaveV2
    for var in sorted(cut):
        if var in tg.rows_alike:
            raise ConfigError(f"the gradient of {var!r} has the same rows on every replica "
                              "(its lookup reads the same ids everywhere, not the batch's), "
                              "so its rows are summed row for row, not exchanged by "
                              f"columns; use ps, allgather or allreduce for {var!r}")
        uses = facts.column_uses(var)
        inside = [op for op in uses.whole_reads + uses.whole_selects
                  if set(tg.ir.node_consumers.get(op, ())) - alone]
        if num_workers > 1 and inside:
            raise ConfigError(f"op {inside[0]!r} reads the whole of {var!r} within a step "
                              f"(its value goes to {sorted(tg.ir.node_consumers[inside[0]])[:3]}"
                              f"); alltoall keeps one part of its columns per replica, and a "
                              f"job of several workers reads no other worker's part in a "
                              f"step; use ps or allgather for {var!r}")
        width = tg.variables[var].shape[1]
        if width < len(devices):
            raise ConfigError(f"alltoall cuts {var!r} into one part of its {width} columns "
                              f"per replica, but the job has {len(devices)} replicas; use "
                              f"ps or allgather for {var!r}")
        part = Columns.even(width, devices)
        out.update({s: part for s in uses.state})
    return out


def balance(tg: TrainingGraph, shared: list[str], servers: list[str],
            sparse: list[str] = (), touched: dict | None = None) -> dict:
    """Each shared variable (with the state it owns) on one server, spread
    evenly by bytes: largest first, each to the least-loaded server; ties go
    to the lower index, so every worker computes the same map.

    A sparse variable bigger than a server's fair share (total / servers),
    whose every use can be cut by rows (`shardable`), is sharded into one
    row range per server first, with each of its same-shape slots; its other
    state and its gradient's aggregation stay with the first range. Its ranges
    hold equal numbers of rows, or equal shares of the sampled rows a step
    touched (`touched`: ps_placement rows_touched, Sharded.by_rows_touched);
    a server's load counts its range's share."""
    size = {v: sum(tg.variables[s].nbytes for s in tg.owned(v)) for v in shared}
    load = [0] * len(servers)
    out = {}
    fair = sum(size.values()) / len(servers)
    for var in sorted(sparse, key=lambda v: (-size[v], v)):
        state = shardable(tg, var, 0) if len(servers) > 1 and size[var] > fair else None
        if not state:
            continue
        sample = (touched or {}).get(var, ())
        sharded = Sharded.by_rows_touched(tg.variables[var].shape[0], servers, sample)
        for s in tg.owned(var):
            out[s] = sharded if s in state else Shared(sharded.home)
        for k, share in enumerate(sharded.shares(sample)):
            load[k] += size[var] * share
    for var in sorted(shared, key=lambda v: (-size[v], v)):
        if var in out:
            continue
        j = min(range(len(servers)), key=lambda i: (load[i], i))
        load[j] += size[var]
        for s in tg.owned(var):
            out[s] = Shared(servers[j])
    return out


def round_robin(tg: TrainingGraph, shared: list[str], servers: list[str]) -> dict:
    """Each shared variable (with its state) on the next server in turn, in
    the order the variables were made (TensorFlow's replica_device_setter)."""
    made = {name: k for k, name in enumerate(tg.variables)}
    out = {}
    for k, var in enumerate(sorted(shared, key=made.get)):
        out.update({s: Shared(servers[k % len(servers)]) for s in tg.owned(var)})
    return out


# Ops the shard_variables pass cuts, by how the variable is sharded.
SHARD_OPS = {
    0: frozenset({"ReadVariableOp", "ResourceGather", "VarIsInitializedOp", "VariableShape",
                  "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"} |
                 {f"ResourceScatter{k}" for k in
                  ("Add", "Sub", "Mul", "Div", "Min", "Max", "Update")}),
    None: frozenset({"ReadVariableOp", "VarIsInitializedOp", "VariableShape",
                     "AssignVariableOp", "AssignAddVariableOp", "AssignSubVariableOp"}),
}


def shardable(tg: TrainingGraph, var: str, axis: int | None) -> list[str] | None:
    """`var` and its state of the same shape, if every op on them takes the
    handle straight from the variable and is one the shard_variables pass
    cuts along `axis` (rows, or the flattened elements: then dense
    ResourceApply* updates too, which act element by element); else None."""
    shape = tg.variables[var].shape
    if not shape or any(d is None for d in shape):
        return None
    state = [s for s in tg.owned(var) if tg.variables[s].shape == shape]
    for s in state:
        for op in set(tg.readers.get(s, ())) | set(tg.writers.get(s, ())):
            node = tg.ir.node(op)
            known = node.op in SHARD_OPS[axis] or node.op.startswith(
                "ResourceSparseApply" if axis == 0 else "ResourceApply")
            handles = [r for r in tg.ir.data_inputs(op) if r.node in tg.variables]
            batched = "batch_dims" in node.attr and node.attr["batch_dims"].i
            if not known or not handles or any(r.node not in state for r in handles) or \
                    batched:
                return None
    return state
