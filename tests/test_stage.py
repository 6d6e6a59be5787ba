"""Stages: no session run of a multi-worker step mixes collectives with
parameter-server work (transforms/stage.py, parallax_ng/stages.py)."""
import pytest
import tensorflow as tf

from models import embedding_regression
from passkit import cluster_transform
from parallax_ng import emit
from parallax_ng.errors import FetchError, GraphError
from parallax_ng.ir import GraphIR
from parallax_ng.stages import Stages
from transforms.stage import COLLECTIVE_OPS, _number, on_server

tf1 = tf.compat.v1


def imported(ir):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(ir.graph_def, name="")
    return g


def pruned(graph, targets):
    """What TensorFlow runs for `targets`: every op they reach."""
    seen, todo = set(), list(targets)
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        seen.add(name)
        op = graph.get_operation_by_name(name)
        todo += [t.op.name for t in op.inputs] + [c.name for c in op.control_inputs]
    return seen


@pytest.mark.parametrize("worker", [0, 1])
def test_every_run_is_collective_only_or_server_only(worker):
    g, h = embedding_regression(4, "adam", clip=True, ema=True)
    ir, ctx = cluster_transform(g, worker=worker, devices=2, dense_method="allreduce")
    stages = ctx.result(Stages)
    graph = imported(ir)
    for fetch in (h["train"].name, h["init"].name):
        runs = stages.split(graph, (fetch,))
        assert [s for s, _ in runs] == sorted({s for s, _ in runs})
        ran = set()
        for stage, targets in runs:
            ops = pruned(graph, targets) - stages.floating
            assert not ops & ran, "an op would run twice"
            ran |= ops
            kinds = {("collective" if graph.get_operation_by_name(o).type in COLLECTIVE_OPS
                      else "server" if on_server(graph.get_operation_by_name(o).device)
                      else "local") for o in ops}
            assert not {"collective", "server"} <= kinds, (stage, kinds)
            assert all(stages.stage_of[o] == stage for o in ops)
    train = [s for s, _ in stages.split(graph, (h["train"].name,))]
    # the clip factor needs the all-reduced dense norm before the embedding update
    assert train == ([0, 1, 2] if worker == 0 else [0, 1])
    for read, write in stages.buffer_write.items():
        assert stages.stage_of[write] < stages.stage_of[read]


def test_jobs_without_parameter_servers_are_one_run_per_step():
    g, _ = embedding_regression(4, "adam", clip=True)
    _, ctx = cluster_transform(g, worker=0, servers=0, run_option="allreduce")
    assert ctx.result(Stages) is None


def test_an_op_made_later_that_spans_stages_is_refused():
    g = tf.Graph()
    with g.as_default():
        a = tf.constant(1.0, name="a")
        b = tf.identity(a, name="b")
        c = tf.identity(a, name="c")
        tf.add(b, c, name="late")
    stages = Stages({"b": 0, "c": 1}, frozenset({"a"}))
    with pytest.raises(FetchError, match="'late' was made after get_runner"):
        stages.split(g, ("late",))


def test_a_loop_with_collectives_and_server_ops_is_refused():
    worker = "/job:worker/replica:0/task:0/device:CPU:0"
    ps = "/job:ps/replica:0/task:0/device:CPU:0"
    f32 = tf.float32
    nodes = [emit.const("x", 1.0, f32, worker),
             emit.node_def("enter", "Enter", ["x"], worker, T=f32, frame_name="loop"),
             emit.node_def("merge", "Merge", ["enter", "next"], worker, T=f32, N=2),
             emit.collective_reduce("sum", "merge", f32, worker, group_size=2, group_key=1,
                                    instance_key=1, mean=False, timeout=10.0),
             emit.node_def("on_ps", "Identity", ["sum"], ps, T=f32),
             emit.node_def("next", "NextIteration", ["on_ps"], worker, T=f32)]
    ir = GraphIR(nodes=nodes, versions=tf1.GraphDef().versions)
    with pytest.raises(GraphError, match="while loop through 'merge'"):
        _number(ir, {"x"})
