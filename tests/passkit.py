"""Helpers for pass unit tests: a PassContext for a small graph, op counts."""
from collections import Counter

from models import embedding_regression
from parallax_ng import frontend
from parallax_ng.analysis import analyze
from parallax_ng.config import Config
from parallax_ng.passes import PassContext
from parallax_ng.planner import make_plan


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


def cluster_transform(graph, worker, servers=1, run_option="hybrid", devices=1, workers=2):
    """Transform `graph` as worker `worker` of a job on made-up loopback ports
    (nothing is started): (GraphIR, PassContext)."""
    import parallax_ng as pn
    from parallax_ng.cluster import ClusterInfo
    info = ClusterInfo(tuple(f"127.0.0.1:{2000 + i}" for i in range(workers)),
                       tuple(f"127.0.0.1:{3000 + j}" for j in range(servers)), "worker",
                       worker, tuple(("CPU", k) for k in range(devices)))
    ir, ctx, _ = pn.transform(graph, config={"run_option": run_option}, cluster_info=info)
    return ir, ctx
