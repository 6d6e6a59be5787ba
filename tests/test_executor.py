"""The step executor: one run, or one per stage, and the job's barrier."""
import tensorflow as tf

from models import embedding_regression
from parallax_ng.executor import Executor, SessionRun
from parallax_ng.results import Barrier
from parallax_ng.stages import Stages
from passkit import cluster_transform, context


def imported(ir):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(ir.graph_def, name="")
    return g


def test_an_unstaged_step_is_one_session_run():
    ctx = context(n=2)
    ex = Executor(tf.Graph(), ctx)
    assert ex.runs(["loss:0", "train"]) == [SessionRun((0, 1))]
    assert ex.barrier is None


def test_a_staged_step_runs_its_stages_in_order_and_fetches_each_value_once():
    g, h = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, servers=1, dense_method="allreduce")
    graph = imported(ir)
    ex = Executor(graph, ctx)
    stages = ctx.result(Stages)
    runs = ex.runs([h["train"].name, "loss:0"])
    assert len(runs) >= 3                                 # server, collectives, server
    fetched = [i for r in runs for i in r.fetched]
    assert sorted(fetched) == [0, 1]
    order = [stages.stage_of_op(graph, r.targets[0]) for r in runs if r.targets]
    assert order == sorted(order)
    assert ex.barrier == Barrier(release="parallax/server_sync/release")
    assert ex.barrier.op(0) == "parallax/server_sync/release" and ex.barrier.op(1) is None
    assert ex.ends_with_barrier(initialized=False, trained=True)


def test_a_step_without_collectives_holds_its_barrier():
    g, h = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, servers=1, dense_method="bfb")
    ex = Executor(imported(ir), ctx)
    assert len(ex.runs([h["train"].name])) == 1 and ex.barrier.folded
    assert ex.ends_with_barrier(initialized=True, trained=False)
    assert not ex.ends_with_barrier(initialized=False, trained=True)


def test_other_workers_wait_at_the_barrier():
    g, _ = embedding_regression(4, "adam")
    ir, ctx = cluster_transform(g, worker=1, servers=1)
    ex = Executor(imported(ir), ctx)
    assert ex.barrier.op(1) == "parallax/server_sync/wait"
    assert ex.graph.get_operation_by_name(ex.barrier.op(1)).type == "QueueDequeueV2"
