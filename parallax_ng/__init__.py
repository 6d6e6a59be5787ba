"""parallax_ng: single-device TensorFlow training graphs, run data-parallel.

    import parallax_ng as pn
    ds = pn.shard(ds)                                      # in the graph
    runner = pn.get_runner(graph, resource_info, config)   # after building it
    runner.run(train_op, feed_dict)
    step = pn.function(train_step, resource_info, config)  # a TF2 step, as written

The package: errors, compat, config, resources and cluster (what the user
gives and where this process runs) are the foundation; graph/ reads and
writes the user's graph, comm/ lowers collectives, planning/ decides,
pipeline/ runs the passes (the package `transforms`), runtime/ drives the
result, l2l/ is layer-to-layer execution, build.py is the one path from a
graph to a Runner, tf2.py brings TF2 steps onto it (keras_fit.py Keras's
fit, evaluate and predict), and tools/ is the
command line and the launcher.
"""
from __future__ import annotations

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
    if name == "function":
        from .tf2 import function
        return function
    if name == "parallelize":
        from .keras_fit import parallelize
        return parallelize
    raise AttributeError(f"module 'parallax_ng' has no attribute {name!r}")


def transform_plan(graph, resource_info=None, config=None):
    """The Plan for `graph` (analysis only; the graph is not rewritten). A
    resource file with several hosts or with servers is planned as the job
    `parallax-ng run` would start, seen from worker 0."""
    from . import build
    from .graph import frontend

    job = build.resolve(resource_info, config, planned=True)
    tg = frontend.load(graph, job.config.batch_norm, job.config.batch_feeds)
    if job.config.l2l.enabled:         # layer by layer: how the model is cut
        from .l2l.runner import l2l_plan
        return l2l_plan(tg, job)
    return build.Build(tg, job).plan()


def transform(graph, resource_info=None, config=None, keep_graphs=False,
              cluster_info=None, horovod=None, plan=None):
    """Analyse, plan and rewrite `graph`; no session is made. `cluster_info`
    is a worker of a job (parallax_ng/cluster.py), `horovod` (rank, size) a
    rank under horovodrun; `plan` replaces the planner's (tests and tools
    build plans by hand).

    Returns (transformed GraphIR, PassContext, PassManager) for tools and
    tests; with keep_graphs the manager holds the graph after every pass.
    """
    from . import build
    from .graph import frontend
    from .resources import load_resources

    resources = None if cluster_info is not None else load_resources(resource_info)
    job = build.make(load_config(config), resources, cluster_info, horovod)
    b = build.Build(frontend.load(graph, job.config.batch_norm, job.config.batch_feeds),
                    job)
    return b.rewrite(plan if plan is not None else b.plan(), keep_graphs)


def get_runner(graph, resource_info=None, config=None):
    """Transform `graph` for the devices in `resource_info`; return a Runner.

    graph: a tf.Graph (or MetaGraphDef, or path of a .meta file) with a
    training op. resource_info: YAML path, dict, or None for this machine's
    devices. config: YAML path, dict or Config; in a job started with
    `parallax-ng run -c FILE`, None means FILE, and a different config is an
    error.
    """
    from . import build
    return build.get_runner(graph, resource_info, config)


__all__ = ["Config", "ConfigError", "FetchError", "GraphError", "ParallaxError",
           "ResourceError", "function", "get_runner", "parallelize", "partitioner", "shard",
           "transform", "transform_plan", "__version__"]
