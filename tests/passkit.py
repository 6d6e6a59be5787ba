"""Helpers for pass unit tests: a PassContext for a small graph, op counts."""
from collections import Counter

from models import embedding_regression
from parallax_ng import frontend
from parallax_ng.analysis import analyze
from parallax_ng.config import Config
from parallax_ng.passes import PassContext
from parallax_ng.plan import make_plan


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
