"""Communication lowered per backend: what TensorFlow's collectives lowering
emits (the Horovod lowering runs in tests/test_horovod.py)."""
import pytest
import tensorflow as tf

from parallax_ng import comm
from parallax_ng.errors import ConfigError
from passkit import context


def lowering(n=2, workers=1, worker=0):
    from dataclasses import replace
    ctx = context(n=n)
    plan = replace(ctx.plan, num_workers=workers, worker=worker)
    return comm.lowering(plan, ctx.instance_keys), plan


def test_all_reduce_is_one_collective_per_replica_with_one_key():
    tf_comm, plan = lowering(n=3)
    nodes, outs = tf_comm.all_reduce("s/x", ["a", "b", "c"], tf.float32, mean=True)
    assert [n.op for n in nodes] == ["CollectiveReduce"] * 3
    assert outs == ["s/x/replica_0", "s/x/replica_1", "s/x/replica_2"]
    assert [n.device for n in nodes] == list(plan.devices)
    assert len({n.attr["instance_key"].i for n in nodes}) == 1
    assert {n.attr["final_op"].s for n in nodes} == {b"Div"}
    _, again = tf_comm.all_reduce("s/y", ["a", "b", "c"], tf.float32, mean=False)
    assert again != outs


def test_all_gather_gathers_sizes_then_padded_slices():
    tf_comm, _ = lowering(n=2)
    nodes, v, i = tf_comm.all_gather("s/g", ["v0", "v1"], ["i0", "i1"], tf.float32, tf.int32,
                                     tf.TensorShape([None, 4]), mean=True)
    gathers = [n for n in nodes if n.op == "CollectiveGatherV2"]
    assert len(gathers) == 6          # sizes, values, indices per replica
    assert len(v) == len(i) == 2 and v[0].startswith("s/g/replica_0/")


def test_broadcast_sends_from_worker_0_and_receives_elsewhere():
    chief, _ = lowering(workers=2, worker=0)
    b = chief.broadcast("s/b", "init_value", tf.float32, [2, 3])
    assert [n.op for n in b.nodes] == ["CollectiveBcastSend"] and b.value == "init_value"
    assert b.before == ["^s/b/send"]
    other, _ = lowering(workers=2, worker=1)
    b = other.broadcast("s/b", "init_value", tf.float32, [2, 3])
    assert [n.op for n in b.nodes] == ["CollectiveBcastRecv"] and b.value == "s/b/recv"


def test_the_horovod_lowering_needs_horovod():
    from dataclasses import replace
    ctx = context(n=2)
    try:
        import horovod.tensorflow  # noqa: F401
    except ImportError:
        h = comm.lowering(replace(ctx.plan, backend="horovod"), ctx.instance_keys)
        with pytest.raises(ConfigError, match="horovod"):
            h.all_reduce("s", ["a", "b"], tf.float32, True)
    else:
        h = comm.lowering(replace(ctx.plan, backend="horovod"), ctx.instance_keys)
        nodes, outs = h.all_reduce("s", ["a", "b"], tf.float32, True)
        assert any(n.op == "HorovodAllreduce" for n in nodes)


def test_many_collectives_per_step_do_not_pile_up_threads():
    """A collective op with a timeout of its own makes TensorFlow start a
    thread per run that sleeps out the timeout: 24 all-reduces a step piled
    up 24 threads a step (a job crashed at about 10,000). The ops carry no
    timeout (the runner bounds each run), and the thread count stays level."""
    import os

    import numpy as np

    import parallax_ng as pn
    from models import local
    tf1 = tf.compat.v1
    g = tf.Graph()
    with g.as_default():
        h = tf.constant(np.ones([4, 8], np.float32))
        for k in range(12):
            with tf1.variable_scope(f"layer_{k}"):
                h = tf.nn.tanh(tf.matmul(h, tf1.get_variable("w", [8, 8])) +
                               tf1.get_variable("b", [8]))
        train = tf1.train.GradientDescentOptimizer(0.01).minimize(tf.reduce_sum(h))
        init = tf1.global_variables_initializer()
    threads = lambda: len(os.listdir("/proc/self/task"))   # noqa: E731
    with pn.get_runner(g, local(2), {"run_option": "allreduce"}) as runner:
        runner.run(init)
        nodes = runner.graph.as_graph_def().node
        reduces = [n for n in nodes if n.op == "CollectiveReduce"]
        assert len(reduces) == 2 * 24 and all(n.attr["timeout_seconds"].f == 0 for n in reduces)
        assert runner._options.timeout_in_ms == 300 * 1000
        for _ in range(5):
            runner.run(train)
        before = threads()
        for _ in range(40):
            runner.run(train)
        assert threads() - before < 40, (before, threads())
