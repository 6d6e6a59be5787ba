"""parallax_ng: single-device TensorFlow training graphs, run data-parallel.

    import parallax_ng as pn
    ds = pn.shard(ds)                                      # in the graph
    runner = pn.get_runner(graph, resource_info, config)   # after building it
    runner.run(train_op, feed_dict)
"""
from __future__ import annotations

import os
import sys
from dataclasses import replace

from .config import Config, load_config
from .errors import ConfigError, FetchError, GraphError, ParallaxError, ResourceError
from .runtime import heartbeat

__version__ = "0.1.0"
heartbeat.start()       # a task of `parallax-ng run` tells its launcher it is alive


def __getattr__(name):
    # TensorFlow is imported on first use, so `parallax-ng --help` and the
    # launcher start at once.
    if name == "shard":
        from .graph.data import shard
        return shard
    if name == "partitioner":
        from .graph.partition import partitioner
        return partitioner
    raise AttributeError(f"module 'parallax_ng' has no attribute {name!r}")


def transform_plan(graph, resource_info=None, config=None):
    """The Plan for `graph` (analysis only; the graph is not rewritten). A
    resource file with several hosts or with servers is planned as the job
    `parallax-ng run` would start, seen from worker 0."""
    from .cluster import ClusterInfo
    from .graph import frontend
    from .resources import load_resources

    resources = load_resources(resource_info)
    job = ClusterInfo.planned(resources) if len(resources.hosts) > 1 or resources.ps else None
    config = load_config(config)
    if config.l2l.enabled:         # layer by layer: how the model is cut
        from .l2l.builder import device_string
        from .l2l.layers import split
        from .l2l.runner import plan_of

        tg = frontend.load(graph)
        devices = job.device_strings() if job else [
            device_string(kind, i) for kind, i in resources.hosts[0].devices]
        return plan_of(split(tg, config.l2l.layers, config.l2l.loss), devices,
                       job.host if job else device_string("CPU", 0), config.l2l,
                       (len(job.workers), 0) if job else (1, 0))
    return _plan(frontend.load(graph), resources, config, job)


def _plan(tg, resources, config: Config, cluster_info=None, horovod=None, profile=None,
          job_order=None):
    """The Plan for a TrainingGraph: of worker `cluster_info` of a job, of
    rank `horovod` = (rank, size) under horovodrun, else of this machine's
    devices in `resources` (a loaded ResourceInfo); with the measurements of
    `profile` (parallax_ng/planning/profile.py) when given. In a job the gradients
    are packed in `job_order` (the same on every worker: `_job_order`),
    and mgwfbp buckets planned with its ready times and all-reduce fit;
    else in the static order."""
    from .planning.analysis import analyze
    from .planning.planner import make_plan
    from .planning.traffic import Layout

    info = analyze(tg)
    order = ()
    if profile is not None:
        info, order = profile.apply(info, tg), profile.order
    if cluster_info is not None:
        job_order = job_order or {"order": [], "source": ""}
        measured = _job_profile(job_order)
        if measured is not None and measured.rows:   # the rows worker 0's step touched
            info = measured.apply(info, tg)
        plan = make_plan(tg, info, config, cluster_info.device_strings(), cluster_info.host,
                         len(cluster_info.workers), cluster_info.task,
                         cluster_info.server_devices(), tuple(job_order["order"]),
                         profile=measured, layout=Layout.of(cluster_info))
        if plan.buffers:
            plan = replace(plan, order_source=job_order["source"])
    else:
        if len(resources.hosts) > 1:
            raise ResourceError(
                f"resource info lists {len(resources.hosts)} hosts; get_runner runs on one "
                "machine's devices. List one host, or start the job with "
                "`parallax-ng run script.py -r resources.yaml`")
        rank, size = horovod or (0, 1)
        if size > 1:     # each rank measures its own step: plan alike on every rank
            order, measured = (), None
            b = config.buckets
            if b.mode == "mgwfbp" and b.a is None and not b.profile:
                raise ConfigError("buckets.mode mgwfbp under Horovod needs the all-reduce "
                                  "cost: buckets.a and buckets.b, or buckets.profile (a "
                                  "`parallax-ng profile` file); ranks do not measure it")
        else:
            measured = profile
        plan = make_plan(tg, info, config, resources.local_device_strings(),
                         "/job:localhost/replica:0/task:0/device:CPU:0",
                         num_workers=size, worker=rank, order=order, profile=measured)
    if profile is not None:
        plan = replace(plan, schedule=replace(plan.schedule, order=profile.order))
    return plan


def transform(graph, resource_info=None, config=None, keep_graphs=False,
              cluster_info=None, horovod=None, plan=None):
    """Analyse, plan and rewrite `graph`; no session is made. `horovod` is
    (rank, size) of a job under horovodrun; `plan` replaces the planner's
    (tests and tools build plans by hand).

    Returns (transformed GraphIR, PassContext, PassManager) for tools and
    tests; with keep_graphs the manager holds the graph after every pass.
    """
    from .graph import frontend
    from .resources import load_resources

    config = load_config(config)
    tg = frontend.load(graph)
    if plan is None:
        resources = None if cluster_info is not None else load_resources(resource_info)
        plan = _plan(tg, resources, config, cluster_info, horovod)
    return _rewrite(tg, plan, config, keep_graphs)


def _rewrite(tg, plan, config: Config, keep_graphs: bool = False):
    """Run the passes the plan needs over the user's graph."""
    import transforms

    from .pipeline.passes import PassContext, PassManager

    ctx = PassContext(tg, plan)
    manager = PassManager(transforms.pipeline_for(plan), config.verify, config.dump_dir,
                          keep_graphs)
    return manager.run(tg.ir, ctx), ctx, manager


def get_runner(graph, resource_info=None, config=None):
    """Transform `graph` for the devices in `resource_info`; return a Runner.

    graph: a tf.Graph (or MetaGraphDef, or path of a .meta file) with a
    training op. resource_info: YAML path, dict, or None for this machine's
    devices. config: YAML path, dict or Config; in a job started with
    `parallax-ng run -c FILE`, None means FILE, and a different config is an
    error.
    """
    from . import cluster
    from .graph import capture, frontend
    from .resources import check_devices, load_resources, session_config
    from .runtime import serving

    profile_steps = capture.check(graph, resource_info, config)
    resource_info, config = capture.resources(resource_info), capture.config(config)
    cfg = _job_config(config)
    heartbeat.set_timeout(cfg.communication.timeout_seconds)
    if profile_steps:      # `parallax-ng plan --profile N`: measure, keep the graph
        from .config import ProfileConfig
        cfg = replace(cfg, profile=ProfileConfig(profile_steps, "never"))
    resources = load_resources(resource_info)
    if cfg.communication.backend == "horovod" and not cfg.l2l.enabled:   # one worker each
        from .comm import horovod
        check_devices(resources.hosts[0].devices)
        rank = horovod.init()
        return _runner(frontend.load(graph), resources, cfg,
                       session_config(resources.hosts[0].devices), horovod=rank)
    if cfg.l2l.enabled:
        return _l2l_runner(frontend.load(graph), resources, cfg,
                           cluster.from_env(resources if resource_info is not None else None))
    info = cluster.from_env(resources if resource_info is not None else None)
    if info is None:
        check_devices(resources.hosts[0].devices)
        return _runner(frontend.load(graph), resources, cfg,
                       session_config(resources.hosts[0].devices))
    if info.task_type == "ps":     # TF_CONFIG convention: a server task only serves
        raise SystemExit(serving.serve(info, cfg.communication.timeout_seconds))
    check_devices(info.devices, f"worker {info.task} ({info.workers[info.task]})")
    server = info.start_server()
    if os.environ.get(cluster.PROFILE_ENV):       # `parallax-ng profile` of a job
        _profile_job(frontend.load(graph), cfg, info, server)
    return _runner(frontend.load(graph), None, cfg, info.session_config(), cluster_info=info,
                   server=server)


def _l2l_runner(tg, resources, config: Config, info):
    """Layer-to-layer execution (parallax_ng/l2l/builder.py): on this machine's
    devices, or as one worker of a job (its own host the EPS)."""
    from .l2l.builder import device_string
    from .l2l.runner import L2LRunner
    from .resources import check_devices, session_config

    if config.communication.backend != "tf":
        raise ConfigError("config key 'l2l' keeps the model on the host of one process; "
                          "'communication.backend: horovod' does not apply to it")
    if info is None:
        devices = resources.hosts[0].devices
        check_devices(devices)
        return L2LRunner(tg, [device_string(kind, i) for kind, i in devices], config,
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


def _profile_job(tg, config: Config, info, server):
    """Measure as a job's workers do before their graph is built (`_job_order`
    with the steps `parallax-ng profile` asked for), worker 0 writes the
    profile in the simulator's format, tell the servers this worker is done
    and end the process."""
    import json

    import tensorflow as tf

    from . import cluster
    from .runtime import serving

    steps, per_variable, path = os.environ[cluster.PROFILE_ENV].split(":", 2)
    shared = _job_order(tg, config, info, server, int(steps))
    profile = _job_profile(shared)
    if info.task == 0:
        if profile is None:
            raise RuntimeError(f"the job's first step was not measured: {shared['source']}")
        profile = replace(profile, rows=dict(shared.get("rows", {})), steps=int(steps))
        with open(path, "w") as f:
            json.dump(profile.simulator(tg, per_variable == "1"), f, indent=1)
            f.write("\n")
        print(profile.format(), flush=True)
    if info.ps:
        graph = tf.Graph()
        ops = serving.done_ops(graph, info.server_devices(), len(info.workers), info.task)
        with tf.compat.v1.Session(server.target, graph=graph,
                                  config=info.session_config()) as session:
            session.run(ops)
    raise SystemExit(0)


def _runner(tg, resources, config: Config, session_config, cluster_info=None, horovod=None,
            server=None):
    """A Runner for `tg`, able to plan again from a profile and rebuild."""
    from .runtime.runner import Runner

    order = _job_order(tg, config, cluster_info, server)

    def replan(profile=None):
        return _plan(tg, resources, config, cluster_info, horovod, profile, order)

    def rebuild(plan):
        ir, ctx, manager = _rewrite(tg, plan, config)
        return ir, ctx, manager.records

    ir, ctx, records = rebuild(replan())
    if ctx.plan.worker == 0:       # once per job: what the config asked that is not done
        for line in ctx.plan.unmet():
            print(f"parallax_ng: {line}", file=sys.stderr, flush=True)
    return Runner(ir, ctx, config, session_config, records, server=server,
                  replan=replan, rebuild=rebuild)


def _job_order(tg, config: Config, cluster_info, server, profile_steps: int = 0
               ) -> dict | None:
    """In a job whose dense gradients go through fusion buffers or mgwfbp
    buckets, or whose plans hybrid or auto weigh (by the rows a step
    touches and the network, parallax_ng/planning/choice.py): what worker 0's first
    step measured, before
    the graph is built
    (parallax_ng/planning/profile.py first_step_profile: the order and times the
    gradients became ready), and, when mgwfbp has no a and b, the all-reduce
    benchmark that every worker runs together (parallax_ng/planning/costfit.py);
    worker 0's results are given once to every worker, so all pack their
    buffers and plan their buckets alike (the others take the same steps
    meanwhile, so the machine is shared as in training). None outside such
    a job. `profile_steps` (`parallax-ng profile` of a job): measure that many
    steps and run the benchmark whatever the plan."""
    from .planning import choice, costfit
    from .planning.profile import first_step_profile
    from .runtime import serving

    if cluster_info is None or server is None or (
            len(cluster_info.workers) < 2 and not profile_steps):
        return None
    plan = _plan(tg, None, config, cluster_info)
    mgwfbp = config.buckets.mode == "mgwfbp" and not config.buckets.profile and any(
        vp.method == "allreduce" for vp in plan.variables.values())
    # auto, and hybrid weighing its plans by their links: the rows a step
    # touches and the network
    weighs = config.run_option == "auto" or choice.weighs(config, len(cluster_info.workers),
                                                          cluster_info.ps)
    if not plan.buffers and not mgwfbp and not weighs and not profile_steps:
        return None
    timeout = config.communication.timeout_seconds
    fit = None
    if mgwfbp and config.buckets.a is None or profile_steps or \
            weighs and config.network.bandwidth is None:
        fit = costfit.measure(server.target, list(plan.devices), plan.group_size,
                              costfit.sizes(costfit.model_bytes(tg, plan)),
                              cluster_info.session_config(), timeout)
    trip = (None, None)
    if weighs and cluster_info.ps and config.network.bandwidth is None:
        trip = costfit.round_trip(server.target, cluster_info.server_devices()[0],
                                  cluster_info.host, cluster_info.session_config(), timeout)
    # every worker steps at once, so worker 0's times have the machine shared
    # as in training; only worker 0's are used
    steps = profile_steps or config.profile.steps
    profile, why = first_step_profile(tg, timeout, steps) if steps else (
        None, "profile.steps is 0")
    mine = None
    if cluster_info.task == 0:
        mine = {"order": list(profile.order) if profile else [],
                "ready": dict(profile.ready) if profile else {},
                "forward_time": profile.forward_time if profile else 0.0,
                "allreduce": fit.to_dict() if fit else None, "round_trip": trip[0],
                "session_run": trip[1],
                "rows": dict(profile.rows) if profile else {},
                "source": "measured in worker 0's first step" if profile else
                          f"the graph's order: not measured, {why}"}
    return serving.share(cluster_info, server, mine, timeout)


def _job_profile(job_order: dict):
    """The Profile worker 0 measured and shared (`_job_order`), or None."""
    from .planning.costfit import Fit
    from .planning.profile import Profile
    if not job_order.get("ready") and not job_order.get("allreduce") and \
            not job_order.get("rows"):
        return None
    fit = job_order.get("allreduce")
    return Profile(1, dict(job_order.get("rows", {})), dict(job_order.get("ready", {})),
                   job_order.get("forward_time", 0.0), Fit.from_dict(fit) if fit else None,
                   job_order.get("round_trip"), job_order.get("session_run"))


def _job_config(config) -> Config:
    """`config`, or the job's (`parallax-ng run -c FILE` sets
    PARALLAX_NG_CONFIG); both given and different is an error."""
    from .cluster import CONFIG_ENV

    path = os.environ.get(CONFIG_ENV)
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


__all__ = ["Config", "ConfigError", "FetchError", "GraphError", "ParallaxError",
           "ResourceError", "get_runner", "partitioner", "shard", "transform", "transform_plan",
           "__version__"]
