"""Helpers for pass unit tests: a PassContext for a small graph, op counts."""
from collections import Counter

from models import embedding_regression
from parallax_ng.graph import frontend
from parallax_ng.planning.analysis import analyze
from parallax_ng.config import Config
from parallax_ng.pipeline.passes import PassContext
from parallax_ng.planning.planner import make_plan


def devices(n, kind="CPU"):
    return [f"/job:localhost/replica:0/task:0/device:{kind}:{k}" for k in range(n)]


HOST = "/job:localhost/replica:0/task:0/device:CPU:0"


def context(n=2, optimizer="sgd", kind="CPU", graph=None, **cfg):
    g = graph or embedding_regression(4, optimizer)[0]
    tg = frontend.load(g)
    plan = make_plan(tg, analyze(tg), Config(**cfg), devices(n, kind), HOST)
    return PassContext(tg, plan)


def run_passes(ctx, *passes):
    ir = ctx.tg.ir
    for p in passes:
        ir, _ = p.run(ir, ctx)
        ir.verify()
    return ir


def op_counts(ir, prefix=""):
    return Counter(n.op for n in ir.nodes if n.name.startswith(prefix))


def cluster_transform(graph, worker, servers=1, run_option="hybrid", devices=1, workers=2,
                      **config):
    """Transform `graph` as worker `worker` of a job on made-up loopback ports
    (nothing is started): (GraphIR, PassContext). `config`: more config keys;
    hybrid's dense variables by fusion buffers unless they say otherwise
    (the planner would choose by the links otherwise: test_choice.py)."""
    import parallax_ng as pn
    from parallax_ng.cluster import ClusterInfo
    info = ClusterInfo(tuple(f"127.0.0.1:{2000 + i}" for i in range(workers)),
                       tuple(f"127.0.0.1:{3000 + j}" for j in range(servers)), "worker",
                       worker, tuple(("CPU", k) for k in range(devices)))
    if run_option == "hybrid" and servers:
        config.setdefault("dense_method", "bfb")
    ir, ctx, _ = pn.transform(graph, config={"run_option": run_option, **config},
                              cluster_info=info)
    return ir, ctx


def tiny_graph(counter: bool = False):
    """x [None, 2] -> matmul w [2, 1] -> mean -> GradientDescent; with
    `counter`, also a non-trainable `seen` += sum(x) run with the step."""
    import tensorflow as tf
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 2], name="x")
        w = tf1.get_variable("w", initializer=[[1.0], [2.0]])
        loss = tf.reduce_mean(tf.matmul(x, w), name="loss")
        train = tf1.train.GradientDescentOptimizer(0.1).minimize(loss, name="train")
        if counter:
            seen = tf1.get_variable("seen", initializer=0.0, trainable=False)
            with tf.control_dependencies([train]):
                tf1.assign_add(seen, tf.reduce_sum(x), name="count")
    return g
