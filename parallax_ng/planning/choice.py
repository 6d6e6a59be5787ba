"""Choice: among the plans a run option allows, the one whose communication
the job's links carry fastest.

Where: a job of several workers (TensorFlow's runtime), `dense_method:
auto`, and `run_option` hybrid or auto with parameter servers, or hybrid
without them where a kernel has factors (the ring, with sparse variables by
all-gather, against the same with kernels by their factors).
- hybrid weighs the dense variables by each of ps (whole variables on
  the servers), bfb (balanced fusion buffers through every server) and
  allreduce (a ring between the workers), each also with the variables
  whose factors cost less by their factors (method factors: a MatMul
  gradient's factors gathered; its product's work counted), each with the
  sparse variables on the servers and by all-gather (`sparse_method`
  fixes them); a step
  with collectives and server work runs them in two session runs at once
  (transforms/split_step.py);
- auto weighs the same dense methods, each alone and with each variable
  by its factors where those cost less (a collective beside the servers
  can cost the step more than the bytes it saves), each with the sparse
  variables by
  EmbRace's per-variable costs (costmodel.py), all on the servers, all by
  their cheapest collective, and all by all-gather (hybrid's way: the
  per-variable costs price each variable alone, so a small table such as
  a softmax bias can come out cheaper by a dense all-reduce through its
  fewer messages, while it sends its whole gradient and costs the step
  more than its rows beside the other tables' all-gathers; the whole-plan
  prediction then weighs both).
Each candidate is a whole plan; `traffic.predict` gives its step's
communication time on the job's links, the busiest one deciding. The
fastest wins; ties go to the candidate with the fewer bytes over all
links, then to the earlier one (ps before bfb: with the same bytes, a
dense update applied once on a server rather than on every worker).

Requires: the planner's candidates (label, Plan), a traffic.Layout and a
costmodel.Network. Guarantees: the same inputs give the same choice on
every worker; the chosen plan carries every candidate's prediction
(`Plan.choice`) for `parallax-ng plan`.
"""
from __future__ import annotations

from dataclasses import replace

from ..methods import method
from . import costmodel, traffic
from .plan import Candidate

DENSE = ("ps", "bfb", "allreduce")
SPARSE = ("ps", "allgather")


def weighs(config, num_workers: int, servers, info: dict) -> bool:
    """Whether the planner chooses a job's dense method by its links: with
    servers, hybrid and auto; without, hybrid where a kernel has factors
    (the ring against the ring with kernels by their factors; auto weighs
    factors variable by variable)."""
    return (num_workers > 1 and config.communication.backend == "tf" and
            config.dense_method == "auto" and config.run_option in ("hybrid", "auto") and
            (bool(servers) or config.run_option == "hybrid" and
             any(vi.factors and not vi.sparse for vi in info.values())))


def options(config, costs: dict, info: dict, net=None, replicas: int = 2,
            servers: int = 1) -> list[tuple[str, object, dict]]:
    """(label, config, costs) of every candidate: the config's dense method
    set (hybrid), or the per-variable cost tables cut to what the candidate
    allows (auto); each dense method also with the variables whose factors
    cost less than it on `net` by their factors (`by_factors`)."""
    if config.run_option == "hybrid":
        sparse = SPARSE if config.sparse_method == "auto" else (config.sparse_method,)
        dense = DENSE if servers else ("allreduce",)
        if not servers:
            sparse = tuple(s for s in sparse if s != "ps") or sparse
        out = []
        for m in dense:
            factored = by_factors(info, config, m, net, replicas, servers) if net else []
            for s in sparse:
                cfg = replace(config, dense_method=m, sparse_method=s)
                out.append((f"dense {m}, sparse {s}", cfg, costs))
                if factored:
                    out.append((f"dense {m} but {_named(factored)} by factors, sparse {s}",
                                replace(cfg, variable_methods={
                                    **dict.fromkeys(factored, "factors"),
                                    **config.variable_methods}), costs))
        return out
    sparse = [v for v in costs if info[v].sparse]
    factored = any(method(f).factored for v, t in costs.items() if not info[v].sparse
                   for f in t)
    ways = {"EmbRace's costs": lambda t: t,
            "on the servers": lambda t: {m: s for m, s in t.items() if method(m).shared} or t,
            "by collectives": lambda t: {m: s for m, s in t.items()
                                         if not method(m).servers} or t,
            "by all-gather": lambda t: {m: s for m, s in t.items() if m == "allgather"} or t}
    out = []
    for m in DENSE:
        for way, cut in ways.items():
            if not sparse and way != "EmbRace's costs":
                continue
            for factors in (False, True) if factored else (False,):
                tables = {v: (cut(t) if info[v].sparse else
                              {m: t.get(m, 0.0), **{f: t[f] for f in t
                                                    if factors and method(f).factored}})
                          for v, t in costs.items()}
                label = f"dense {m}" + " or by factors where cheaper" * factors
                out.append((f"{label}, sparse {way}" if sparse else label, config, tables))
    return out


def by_factors(info: dict, config, dense: str, net, replicas: int, servers: int) -> list[str]:
    """The dense variables (not named in `variable_methods`) whose gradients
    are products of factors with known rows and whose factors' predicted
    seconds (their bytes and the product they add, costmodel.py) are below
    dense method `dense`'s."""
    return sorted(v for v, vi in info.items()
                  if not vi.sparse and vi.weighable_factors and
                  v not in config.variable_methods and
                  costmodel.seconds("factors", vi, replicas, servers, net) <
                  costmodel.seconds(dense, vi, replicas, servers, net))


def _named(variables: list[str]) -> str:
    return ", ".join(variables) if len(variables) <= 2 else f"{len(variables)} variables"


def best(candidates: list[tuple[str, object]], layout: traffic.Layout, network,
         index_bytes: dict):
    """The fastest of `candidates` (label, Plan), carrying the predictions."""
    seen, weighed = {}, []
    for label, plan in candidates:
        key = plan.methods()
        if key in seen:       # the same methods by another road
            continue
        seen[key] = label
        p = traffic.predict(plan, layout, network, index_bytes)
        total = sum(p.links.sent.values()) + sum(p.links.local.values())
        weighed.append((p.seconds, total, len(weighed), label, plan, p, key))
    weighed.sort(key=lambda w: w[:3])
    winner = weighed[0]
    choice = tuple(Candidate(label, _end(layout, p),
                             *((p.nbytes, p.nbytes) if p.inside else
                               (p.links.sent.get(p.end, 0.0), p.links.received.get(p.end, 0.0))),
                             total, p.link_seconds, p.fixed_seconds, seconds,
                             label == winner[3], key)
                   for seconds, total, _, label, _, p, key in weighed)
    return replace(winner[4], choice=choice, network=network.describe())


def _end(layout: traffic.Layout, p) -> str:
    """The busiest end, named: its host and tasks, or its loopback."""
    if not p.end:
        return ""
    if p.inside:
        return f"{p.end} loopback"
    return layout.describe(p.end)
