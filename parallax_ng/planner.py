"""Planner: the transformation's decisions, in three separate steps.

1. policy, `choose_methods`: an aggregation method per trained variable,
   from the run option, per-variable overrides and the analysis;
2. placement, `shared_roots`: which trained variables exist once (method
   ps); everything a variable owns (slots, moving averages) goes with it;
3. device map, `map_devices`: a Placement for every variable: mirrored;
   shared on the host in-process; in a job spread over the servers by
   bytes, a large sparse variable cut into row ranges (`balance`).

`make_plan` composes them with the random streams, input producers and
the step schedule. Requires: a TrainingGraph, its analysis, a Config and
the devices. Guarantees: the same inputs give the same plan on every worker.
"""
from __future__ import annotations

from . import queues, randomness
from .analysis import VariableInfo
from .config import Config
from .errors import ConfigError
from .frontend import TrainingGraph
from .placement import MIRRORED, Shared, Sharded
from .plan import Plan, Schedule, VariablePlan


def make_plan(tg: TrainingGraph, info: dict[str, VariableInfo], config: Config,
              devices: list[str], host: str, num_workers: int = 1, worker: int = 0,
              servers: list[str] = ()) -> Plan:
    variables = {name: VariablePlan(name, method, info[name])
                 for name, method in choose_methods(info, config).items()}
    roots = shared_roots(variables)
    _check_servers(tg, roots, config, num_workers, servers)
    placement = map_devices(tg, roots, host, servers if num_workers > 1 or servers else ())
    producers = [q for q in queues.find(tg) if q.producer]
    random = randomness.decide(randomness.random_ops(tg.ir.nodes, tg.ir.library),
                               config.random, config.random_ops,
                               pinned={op for q in producers for op in q.random})
    job_servers = num_workers > 1 and bool(roots)
    return Plan(config.run_option, config.average_dense, config.average_sparse,
                tuple(devices), host, variables, placement,
                timeout_seconds=config.communication.timeout_seconds,
                num_workers=num_workers, worker=worker, servers=tuple(servers),
                backend=config.communication.backend, random=random,
                split_queues={q.queue: q.enqueues for q in producers},
                schedule=Schedule(staged=job_servers))


# -- 1. policy -----------------------------------------------------------------
def choose_methods(info: dict[str, VariableInfo], config: Config) -> dict[str, str]:
    unknown = set(config.variable_methods) - set(info)
    if unknown:
        raise ConfigError(f"config key 'variable_methods' names {sorted(unknown)}, which "
                          f"are not trained variables; trained: {sorted(info)}")
    out = {}
    for name, vi in info.items():
        method = config.variable_methods.get(name) or _default_method(config.run_option, vi)
        if method == "allgather" and not vi.sparse:
            raise ConfigError(f"config key 'variable_methods.{name}' is allgather, but "
                              f"{name} has a dense gradient; use allreduce or ps")
        out[name] = method
    return out


def _default_method(run_option: str, vi: VariableInfo) -> str:
    if run_option == "ps":
        return "ps"
    if run_option == "allreduce":
        return "allgather" if vi.sparse else "allreduce"
    return "ps" if vi.sparse else "allreduce"


# -- 2. placement -----------------------------------------------------------------
def shared_roots(variables: dict[str, VariablePlan]) -> list[str]:
    """Trained variables that exist once (and with them what they own)."""
    return sorted(v for v, vp in variables.items() if vp.shared)


def _check_servers(tg, roots, config, num_workers, servers) -> None:
    if not roots or num_workers == 1 and not servers:
        return
    shared = sorted(s for r in roots for s in tg.owned(r))
    if config.communication.backend == "horovod" and num_workers > 1:
        raise ConfigError(
            f"run_option {config.run_option!r} puts {shared[:5]} on parameter servers, which "
            "communication.backend horovod does not have; use run_option: allreduce "
            "(sparse gradients by Horovod's allgather), or backend tf with `ps:` servers")
    if not servers:
        raise ConfigError(
            f"run_option {config.run_option!r} puts {shared[:5]} on parameter servers, "
            "but the job has none; list `ps: [address]` in the resource file, or use "
            "run_option: allreduce (sparse gradients by AllGather)")


# -- 3. device map ------------------------------------------------------------------
def map_devices(tg: TrainingGraph, roots: list[str], host: str, servers=()) -> dict:
    """A Placement for every variable: the state of `roots` on the host, or
    balanced over `servers`; the rest mirrored."""
    placement = {name: MIRRORED for name in tg.variables}
    if servers:
        sparse = [v for v in roots if v in tg.gradients and tg.gradients[v].sparse]
        placement.update(balance(tg, roots, list(servers), sparse))
    else:
        placement.update({s: Shared(host) for r in roots for s in tg.owned(r)})
    return placement


def balance(tg: TrainingGraph, shared: list[str], servers: list[str],
            sparse: list[str] = ()) -> dict:
    """Each shared variable (with the state it owns) on one server, spread
    evenly by bytes: largest first, each to the least-loaded server; ties go
    to the lower index, so every worker computes the same map.

    A sparse variable bigger than a server's fair share (total / servers),
    whose every use can be cut by rows (`shardable`), is sharded into one
    row range per server first, with each of its same-shape slots; its other
    state and its gradient's aggregation stay with the first range.
    """
    size = {v: sum(tg.variables[s].nbytes for s in tg.owned(v)) for v in shared}
    load = [0] * len(servers)
    out = {}
    fair = sum(size.values()) / len(servers)
    for var in sorted(sparse, key=lambda v: (-size[v], v)):
        state = shardable(tg, var, 0) if len(servers) > 1 and size[var] > fair else None
        if not state:
            continue
        rows = tg.variables[var].shape[0]
        sharded = Sharded.even(0, rows, servers)
        for s in tg.owned(var):
            out[s] = sharded if s in state else Shared(sharded.home)
        for k, shard in enumerate(sharded.shards):
            load[k] += size[var] * shard.size // rows
    for var in sorted(shared, key=lambda v: (-size[v], v)):
        if var in out:
            continue
        j = min(range(len(servers)), key=lambda i: (load[i], i))
        load[j] += size[var]
        for s in tg.owned(var):
            out[s] = Shared(servers[j])
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
