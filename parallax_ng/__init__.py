"""parallax_ng: single-device TensorFlow training graphs, run data-parallel.

    import parallax_ng as pn
    ds = pn.shard(ds)                                      # in the graph
    runner = pn.get_runner(graph, resource_info, config)   # after building it
    runner.run(train_op, feed_dict)
"""
from __future__ import annotations

from .config import Config, load_config
from .data import shard
from .errors import ConfigError, FetchError, GraphError, ParallaxError, ResourceError

__version__ = "0.1.0"


def transform_plan(graph, resource_info=None, config=None):
    """The Plan for `graph` (analysis only; the graph is not rewritten)."""
    return _analyse(graph, resource_info, config)[1]


def _analyse(graph, resource_info, config):
    from . import frontend
    from .analysis import analyze
    from .plan import make_plan
    from .resources import load_resources

    config = load_config(config)
    resources = load_resources(resource_info)
    if len(resources.hosts) > 1:
        raise ResourceError(
            f"resource info lists {len(resources.hosts)} hosts; get_runner runs on one "
            "machine's devices. List one host, or start a multi-machine job with the "
            "cluster launcher")
    host = "/job:localhost/replica:0/task:0/device:CPU:0"
    tg = frontend.load(graph)
    plan = make_plan(tg, analyze(tg), config, resources.local_device_strings(), host)
    return tg, plan, config


def transform(graph, resource_info=None, config=None, keep_graphs=False):
    """Analyse, plan and rewrite `graph`; no session is made.

    Returns (transformed GraphIR, PassContext, PassManager) for tools and
    tests; with keep_graphs the manager holds the graph after every pass.
    """
    import transforms
    from .passes import PassContext, PassManager

    tg, plan, config = _analyse(graph, resource_info, config)
    ctx = PassContext(tg, plan)
    manager = PassManager(transforms.default_pipeline(), config.verify, config.dump_dir,
                          keep_graphs)
    ir = manager.run(tg.ir, ctx)
    return ir, ctx, manager


def get_runner(graph, resource_info=None, config=None):
    """Transform `graph` for the devices in `resource_info`; return a Runner.

    graph: a tf.Graph (or MetaGraphDef, or path of a .meta file) with a
    training op. resource_info: YAML path, dict, or None for this machine's
    devices. config: YAML path, dict or Config.
    """
    from . import capture
    from .runner import Runner

    capture.check(graph, resource_info, config)
    cfg = load_config(config)
    ir, ctx, manager = transform(graph, resource_info, cfg)
    return Runner(ir, ctx, cfg, manager.records)


__all__ = ["Config", "ConfigError", "FetchError", "GraphError", "ParallaxError",
           "ResourceError", "get_runner", "shard", "transform", "transform_plan",
           "__version__"]
