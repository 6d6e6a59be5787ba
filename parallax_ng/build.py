"""Build: the one path from a user's graph to a Runner.

    job = resolve(resource_info, config)       # once: where this process trains
    build = Build(frontend.load(graph), job)   # the analysis, once
    plan = build.plan()                        # planning/planner.py
    ir, ctx, manager = build.rewrite(plan)     # the passes (transforms/)
    Runner(transformed(ir, ctx, ...), ...)     # runtime/program.py, runtime/runner.py

`resolve` reads the config (the job's, `parallax-ng run -c FILE`, checked
against the one given), the resources, this process's place in a job
(parallax_ng/cluster.py) or its Horovod rank, and the profile file
`buckets.profile` names: nothing below reads them again. A front end gives
a TrainingGraph (graph/frontend.py today); everything after it is shared.
Layer-to-layer execution builds its own graph from the same TrainingGraph
and gives the same Runner a Program of it (l2l/runner.py).

In a multi-process job whose plan needs measurements (fusion buffers or
mgwfbp buckets packed by ready times; hybrid and auto weighing whole plans
by the rows a step touches and the network), every worker measures before
its graph is built (`measure_job`) and takes worker 0's results, so every
worker plans alike; otherwise the first plan is the plan.

Requires: a TrainingGraph. Guarantees: the same inputs give the same plan
on every worker; what a config asks and the plan does not do is printed
once per job, by worker 0 (Plan.unmet).
"""
from __future__ import annotations

import copy
import os
import sys
import warnings
from dataclasses import dataclass, replace
from typing import NamedTuple

from . import cluster
from .config import Config, load_config
from .errors import ConfigError, GraphError, ResourceError
from .methods import method
from .resources import ResourceInfo, check_devices, load_resources, session_config


@dataclass(frozen=True)
class Job:
    """Where this process trains: this machine's devices (`resources`),
    a worker of a multi-process job (`cluster`), or a Horovod rank
    (`horovod` = (rank, size), its devices in `resources`)."""
    config: Config
    resources: ResourceInfo | None = None
    cluster: cluster.ClusterInfo | None = None
    horovod: tuple[int, int] | None = None
    bucket_profile: object = None      # buckets.profile, read (planning/profile.py)

    @property
    def workers(self) -> int:
        return len(self.cluster.workers) if self.cluster else (self.horovod or (0, 1))[1]


def resolve(resource_info=None, config=None, planned: bool = False) -> Job:
    """The Job of this process, from the environment a launcher or an
    orchestrator set (a Horovod rank, a worker of a job), else this
    machine's devices. `planned`: a resource file with several hosts or
    with servers is the job `parallax-ng run` would start, seen from worker
    0 (nothing is started; the config is the one given)."""
    cfg = load_config(config) if planned else job_config(config)
    resources = load_resources(resource_info)
    if planned:
        several = len(resources.hosts) > 1 or resources.ps
        return make(cfg, resources, cluster.ClusterInfo.planned(resources) if several else None)
    if cfg.communication.backend == "horovod" and not cfg.l2l.enabled:   # one worker each
        from .comm import horovod
        check_devices(resources.hosts[0].devices)
        return make(cfg, resources, horovod=horovod.init())
    info = cluster.from_env(resources if resource_info is not None else None)
    return make(cfg, resources, info)


def make(config: Config, resources: ResourceInfo | None = None,
         cluster_info: cluster.ClusterInfo | None = None,
         horovod: tuple[int, int] | None = None) -> Job:
    """The Job of a worker of a multi-process job (`cluster_info`), of a
    Horovod rank (`horovod` = (rank, size)), else of the devices in
    `resources`, with the profile file `buckets.profile` read."""
    b = config.buckets
    profile = None
    if b.profile:
        from .planning.profile import from_file
        profile = from_file(b.profile)
        if b.a is None and profile.allreduce is None:
            raise ConfigError(f"buckets.profile {b.profile!r} has no all-reduce fit "
                              "(`allreduce`); give buckets.a and buckets.b, or profile with "
                              "parallax-ng profile")
    if cluster_info is not None:
        return Job(config, None, cluster_info, bucket_profile=profile)
    if horovod is not None and horovod[1] > 1 and b.mode == "mgwfbp" and b.a is None and \
            not b.profile:
        raise ConfigError("buckets.mode mgwfbp under Horovod needs the all-reduce cost: "
                          "buckets.a and buckets.b, or buckets.profile (a `parallax-ng "
                          "profile` file); ranks do not measure it")
    if len(resources.hosts) > 1:
        raise ResourceError(
            f"resource info lists {len(resources.hosts)} hosts; get_runner runs on one "
            "machine's devices. List one host, or start the job with "
            "`parallax-ng run script.py -r resources.yaml`")
    return Job(config, resources, None, horovod, profile)


def job_config(config) -> Config:
    """`config`, or the job's (`parallax-ng run -c FILE` sets
    PARALLAX_NG_CONFIG); both given and different is an error. A job the
    launcher restarts (`--restarts`) checkpoints to the directory it names
    (PARALLAX_NG_CHECKPOINT_DIR) unless the config sets `checkpoint.dir`."""
    cfg = _given_or_jobs(config)
    default = os.environ.get(cluster.CHECKPOINT_ENV)
    if default and cfg.checkpoint.dir is None:
        cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, dir=default))
    return cfg


def _given_or_jobs(config) -> Config:
    path = os.environ.get(cluster.CONFIG_ENV)
    if not path:
        return load_config(config)
    job = load_config(path)
    if config is None:
        return job
    given = load_config(config)
    if given != job:
        raise ConfigError(
            f"get_runner was given a config that differs from the job's (parallax-ng run "
            f"-c {path}); pass config=None to use the job's, or start the job without -c")
    return given


class Build:
    """The analyses of `tg` (once: its VariableInfo and the Facts the
    planner and the passes share) and its plans and rewrites for `job`.
    `shared`: what worker 0 measured before the graph was built and gave
    every worker (`measure_job`), or None."""

    def __init__(self, tg, job: Job, shared: dict | None = None):
        from .planning.analysis import analyze
        from .planning.facts import Facts
        self.tg, self.job = tg, job
        self.info, self.facts = analyze(tg), Facts(tg)
        self._ranges: dict = {}    # the collective key ranges its graphs took (comm/keys.py)
        self.share(shared)

    def share(self, shared: dict | None) -> None:
        """Plan from now on with what worker 0 measured (`measure_job`)."""
        self.shared = shared
        self.measured = job_profile(shared) if shared else None
        self._plain = None       # the plan without a profile of this process's steps

    def configured(self, config) -> "Build":
        """This build with another config: the same analyses and what
        worker 0 measured (tuned sizes, parallax_ng/runtime/tuning.py)."""
        other = copy.copy(self)
        other.job, other._plain = replace(self.job, config=config), None
        return other

    def plan(self, profile=None):
        """The Plan; with `profile`, a step this process measured
        (planning/profile.py), whose rows, ready times and fit it uses."""
        if profile is None and self._plain is not None:
            return self._plain
        from .planning.planner import make_plan
        from .planning.traffic import Layout

        tg, job, config, info = self.tg, self.job, self.job.config, self.info
        order = ()
        if profile is not None:
            info, order = profile.apply(info, tg), profile.order
        if job.cluster is not None:
            if self.measured is not None and (self.measured.rows or
                                              self.measured.factor_rows):   # worker 0's rows
                info = self.measured.apply(info, tg)
            c = job.cluster
            plan = make_plan(tg, info, config, c.device_strings(), c.host, len(c.workers),
                             c.task, c.server_devices(),
                             tuple(self.shared["order"]) if self.shared else (),
                             profile=self.measured, layout=Layout.of(c),
                             bucket_profile=job.bucket_profile, facts=self.facts)
            if plan.buffers:
                plan = replace(plan, order_source=(self.shared or {}).get("source", ""))
        else:
            rank, size = job.horovod or (0, 1)
            measured = None if size > 1 else profile   # every rank plans alike
            plan = make_plan(tg, info, config, job.resources.local_device_strings(),
                             "/job:localhost/replica:0/task:0/device:CPU:0",
                             num_workers=size, worker=rank, order=() if size > 1 else order,
                             profile=measured, bucket_profile=job.bucket_profile,
                             facts=self.facts)
        if profile is not None:
            return replace(plan, schedule=replace(plan.schedule, order=profile.order))
        self._plain = plan
        return plan

    def rewrite(self, plan, keep_graphs: bool = False, graph: int = 0):
        """(transformed GraphIR, PassContext, PassManager): the passes the
        plan needs, run over the user's graph; `graph`: how many graphs
        this process built before (its collectives take keys of their own:
        a job's workers keep what earlier graphs' keys meant)."""
        import transforms

        from .comm.keys import graph_keys
        from .pipeline.passes import PassContext, PassManager

        config = self.job.config
        ctx = PassContext(self.tg, plan, facts=self.facts,
                          instance_keys=graph_keys(graph, self._ranges))
        manager = PassManager(transforms.pipeline_for(plan), config.verify, config.dump_dir,
                              keep_graphs)
        return manager.run(self.tg.ir, ctx), ctx, manager


class Sample(NamedTuple):
    """What a graph's placeholders are fed in its first step (a TF2 step's,
    parallax_ng/tf2.py), so a job can measure that step before building
    (`measure_job`): tensor name -> value."""
    batch: dict           # a global batch (each replica's part is its 1/G)
    fixed: dict           # fed as they are (the variables' initial values)


def get_runner(graph, resource_info=None, config=None, sample: Sample | None = None):
    """`pn.get_runner`: resolve the job, load the graph (front end), and the
    Runner (`parallax-ng profile` measures the steps it asks for)."""
    from .graph import capture, frontend
    from .runtime import heartbeat

    profile_steps = capture.check(graph, resource_info, config)
    job = resolve(capture.resources(resource_info), capture.config(config))
    heartbeat.set_timeout(job.config.communication.timeout_seconds)
    tg = frontend.load(graph, job.config.batch_norm, job.config.batch_feeds)
    return runner(tg, job, profile_steps, sample)


def _fed_alone(tg, job: Job) -> None:
    """Variables an optimizer updates from fed values (gradients summed in
    Python, graph/accumulation.py `fed_variables`) train in one process: in
    a job each worker's fetch of a gradient is its own replicas' mean, so
    the workers would feed apart and part; layer-to-layer applies none."""
    if not (job.config.l2l.enabled or job.cluster is not None and len(job.cluster.workers) > 1):
        return
    from .graph.accumulation import fed_variables
    fed = fed_variables(tg)
    if not fed:
        return
    raise GraphError(
        f"the graph's optimizers apply fed values to {fed[:5]}"
        f"{f' and {len(fed) - 5} more' if len(fed) > 5 else ''} (gradients fetched, summed "
        "in Python and fed back through placeholders), which trains in one process, on its "
        "devices, " + ("not under layer-to-layer (l2l: it applies what the graph computes)"
                       if job.config.l2l.enabled else
                       f"not in a job of {len(job.cluster.workers)} workers: each worker's "
                       "fetched gradients are its own replicas' mean, so the workers' sums "
                       "would differ")
        + ". Or apply the gradients in the graph: opt.apply_gradients(zip(grads, tvars)), "
        "summed over runs in variables of the script's own (docs/usage.md, gradient "
        "accumulation)")


def runner(tg, job: Job, profile_steps: int = 0, sample: Sample | None = None):
    """The Runner of `tg` for `job` (in a job, this worker's server started;
    a parameter-server task serves instead and never returns). With
    `profile_steps` (`parallax-ng plan --profile N`) the runner measures
    that many steps and keeps its graph. `sample`: the first step's feeds,
    which a job measures it with."""
    config = job.config
    if profile_steps:
        from .config import ProfileConfig
        job = replace(job, config=replace(config, profile=ProfileConfig(profile_steps,
                                                                        "never")))
    _fed_alone(tg, job)
    if job.config.l2l.enabled:
        from .l2l.runner import l2l_runner
        made = l2l_runner(tg, job)
        if job.cluster is not None and job.cluster.task == 0:   # its workers split inputs
            _say(_inputs_apart(tg, len(job.cluster.workers), queues=False))
        return made
    info, server = job.cluster, None
    if info is not None:
        if info.task_type == "ps":      # TF_CONFIG convention: a server task only serves
            from .runtime.serving import serve_task
            serve_task(info, config.communication.timeout_seconds)
        check_devices(info.devices, f"worker {info.task} ({info.workers[info.task]})")
        server = info.start_server()
        build = Build(tg, job)
        build.share(measure_job(build, server, sample=sample))
        if sample is not None:        # a TF2 step: every worker's global batch alike
            from .runtime.serving import same_batches
            same_batches(info, server, sample.batch, config.communication.timeout_seconds)
        sessions = info.session_config()
    else:
        check_devices(job.resources.hosts[0].devices)
        build, sessions = Build(tg, job), session_config(job.resources.hosts[0].devices)
    return _runner(build, sessions, server)


def _inputs_apart(tg, replicas: int, queues: bool = True) -> list[str]:
    """The lines that name inputs `replicas` replicas read otherwise than
    one device with their global batch (graph/data.py, graph/queues.py)."""
    from .graph.data import rows_apart, uneven_ends
    from .graph.queues import readers_apart
    if replicas < 2:
        return []
    return uneven_ends(tg.graph, replicas) + rows_apart(tg.graph) + (
        readers_apart(tg) if queues else [])


def _say(lines: list[str]) -> None:
    for line in lines:
        print(f"parallax_ng: {line}", file=sys.stderr, flush=True)


def _runner(build: Build, sessions, server):
    from .runtime.program import transformed
    from .runtime.runner import Runner

    def rebuild(plan, graph: int = 0):
        ir, ctx, manager = build.rewrite(plan, graph=graph)
        return transformed(ir, ctx, build.job.config, manager.records, server is not None)

    program = rebuild(build.plan())
    if program.worker == 0:       # once per job: what the config asked that is not done
        _say(program.plan.unmet() + _inputs_apart(build.tg, program.plan.group_size))
    return Runner(program, build.job.config, sessions, server=server,
                  replan=build.plan, rebuild=rebuild,
                  tuner=_tuner(build, server, rebuild, program.plan))


def _tuner(build: Build, server, rebuild, plan):
    """The Tuner of `tuning.plans`, `buckets.mode: auto` and
    `fusion.buffer_bytes: auto` (parallax_ng/runtime/tuning.py), or None. A
    job's workers plan each plan and size without their own profile (so
    alike) and take worker 0's choice. `plan`: the one training begins
    with (auto plans are timed where its planner weighed several)."""
    from .runtime import serving, tuning

    info, asked = build.job.cluster, tuning.asked(build.job.config)
    config = tuning.settled(build.job.config, plan)
    if not tuning.knobs(config):
        return None
    if build.job.horovod and build.job.horovod[1] > 1:
        if build.job.horovod[0] == 0 and asked:
            warnings.warn(f"{asked}: plans and sizes are not tried under "
                          "Horovod (each rank builds its own graph); the predicted plan and "
                          "default sizes train", stacklevel=4)
        return None

    def plan_of(config, profile):
        return build.configured(config).plan(None if info is not None else profile)

    def decide(mine):
        if info is None:
            return mine
        return serving.share(info, server, mine, config.communication.timeout_seconds)

    return tuning.Tuner(config, plan_of, rebuild, decide, info.task if info else 0, asked)


def measure_job(build: Build, server, profile_steps: int = 0,
                sample: Sample | None = None) -> dict | None:
    """In a job whose dense gradients go through fusion buffers or mgwfbp
    buckets, whose plans hybrid or auto weigh (by the rows a step
    touches and the network, planning/choice.py), or that cuts a table
    into row ranges where the rows a step touches split evenly
    (ps_placement rows_touched, planner.balance): what worker 0's first
    step measured before the graph is built (planning/profile.py
    first_step_profile: the order and times the gradients became ready,
    how many rows they touched and which), and, when mgwfbp has no a and b or the plans
    are weighed without a configured network, the all-reduce benchmark and
    the server round trip every worker runs together
    (planning/costfit.py); worker 0's results are given once to every
    worker (runtime/serving.py share), so all plan alike (the others take
    the same steps meanwhile, so the machine is shared as in training).
    None outside such a job. `profile_steps` (`parallax-ng profile` of a
    job): measure that many steps and run the benchmark whatever the plan.
    `sample`: the feeds the first step is measured with, one replica's
    rows of the batch (its first 1/G)."""
    from .planning import choice, costfit
    from .planning.profile import first_step_profile
    from .runtime import serving
    from .runtime.batch_parts import first_part

    tg, info, config = build.tg, build.job.cluster, build.job.config
    if info is None or server is None or (len(info.workers) < 2 and not profile_steps):
        return None
    plan = build.plan()
    mgwfbp = config.buckets.mode == "mgwfbp" and not config.buckets.profile and any(
        method(vp.method).all_reduced for vp in plan.variables.values())
    weighs = config.run_option == "auto" or \
        choice.weighs(config, len(info.workers), info.ps, build.info)
    cut = config.ps_placement == "rows_touched" and any(
        p.axis == 0 for p in plan.sharded().values())       # row ranges by the rows touched
    if not plan.buffers and not mgwfbp and not weighs and not cut and not profile_steps:
        return None
    timeout = config.communication.timeout_seconds
    fit = None
    if mgwfbp and config.buckets.a is None or profile_steps or \
            weighs and config.network.bandwidth is None:
        fit = costfit.measure(server.target, list(plan.devices), plan.group_size,
                              costfit.sizes(costfit.model_bytes(tg, plan)),
                              info.session_config(), timeout)
    trip = (None, None)
    if weighs and info.ps and config.network.bandwidth is None:
        trip = costfit.round_trip(server.target, info.server_devices()[0], info.host,
                                  info.session_config(), timeout)
    flops = None
    if weighs and any(vi.factors for vi in build.info.values()):
        flops = costfit.matmul_rate(build.info, plan.group_size)
    steps = profile_steps or config.profile.steps
    feeds = {}
    if sample is not None:
        feeds = {**first_part(sample.batch, plan.group_size), **sample.fixed}
    profile, why = first_step_profile(tg, timeout, steps, feeds, len(plan.devices)) \
        if steps else (None, "profile.steps is 0")
    mine = None
    if info.task == 0:
        mine = {"order": list(profile.order) if profile else [],
                "ready": dict(profile.ready) if profile else {},
                "forward_time": profile.forward_time if profile else 0.0,
                "allreduce": fit.to_dict() if fit else None, "round_trip": trip[0],
                "session_run": trip[1],
                "rows": dict(profile.rows) if profile else {},
                "factor_rows": dict(profile.factor_rows) if profile else {}, "flops": flops,
                "touched": {v: list(t) for v, t in profile.touched.items()} if profile else {},
                "source": "measured in worker 0's first step" if profile else
                          f"the graph's order: not measured, {why}"}
    return serving.share(info, server, mine, timeout)


def job_profile(shared: dict):
    """The Profile worker 0 measured and shared (`measure_job`), or None."""
    from .planning.costfit import Fit
    from .planning.profile import Profile
    if not any(shared.get(k) for k in ("ready", "allreduce", "rows", "factor_rows")):
        return None
    fit = shared.get("allreduce")
    return Profile(1, dict(shared.get("rows", {})), dict(shared.get("ready", {})),
                   shared.get("forward_time", 0.0), Fit.from_dict(fit) if fit else None,
                   shared.get("round_trip"), shared.get("session_run"),
                   dict(shared.get("factor_rows", {})), shared.get("flops"),
                   {v: tuple(t) for v, t in shared.get("touched", {}).items()})
