"""Communication lowered per backend: what TensorFlow's collectives lowering
emits (the Horovod lowering runs in tests/test_horovod.py)."""
import pytest
import tensorflow as tf

from parallax_ng.comm import collectives as comm
from parallax_ng.comm.lowering import lowering as lower
from parallax_ng.errors import ConfigError
from passkit import context


def lowering(n=2, workers=1, worker=0):
    from dataclasses import replace
    ctx = context(n=n)
    plan = replace(ctx.plan, num_workers=workers, worker=worker)
    return lower(plan, ctx.instance_keys), plan


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
    assert len(gathers) == 4          # per replica sizes, then values and indices as words
    assert len(v) == len(i) == 2 and v[0].startswith("s/g/replica_0/")
    # rows of unknown width cannot be words: values and indices apart
    nodes, _, _ = tf_comm.all_gather("s/h", ["v0", "v1"], ["i0", "i1"], tf.float32, tf.int32,
                                     tf.TensorShape([None, None]), mean=True)
    assert len([n for n in nodes if n.op == "CollectiveGatherV2"]) == 6


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
        h = lower(replace(ctx.plan, backend="horovod"), ctx.instance_keys)
        with pytest.raises(ConfigError, match="horovod"):
            h.all_reduce("s", ["a", "b"], tf.float32, True)
    else:
        h = lower(replace(ctx.plan, backend="horovod"), ctx.instance_keys)
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
    config = {"run_option": "allreduce", "buckets": {"mode": "none"}}   # one per variable
    with pn.get_runner(g, local(2), config) as runner:
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


def test_columns_exchange_with_uneven_rows_and_widths():
    """Three replicas with 3, 1 and 0 ids (a short last batch), a table of 5
    columns cut 2, 2, 1: every replica gets the full rows of its own ids,
    repeated ids included, and every replica's gradient rows with its own
    columns (scaled for a mean), by real collectives."""
    import numpy as np

    from parallax_ng.planning.placement import Columns
    from parallax_ng.resources import session_config
    tf_comm, plan = lowering(n=3)
    part = Columns.even(5, plan.devices)
    table = np.arange(8 * 5, dtype=np.float32).reshape(8, 5)
    ids = [np.array([7, 2, 7], np.int64), np.array([4], np.int64), np.zeros([0], np.int64)]
    grads = [np.random.RandomState(k).randn(len(i), 5).astype(np.float32)
             for k, i in enumerate(ids)]
    distinct_ids = [np.array(list(dict.fromkeys(i.tolist())), np.int64) for i in ids]
    distinct_rows = [np.random.RandomState(9 + k).randn(len(i), 5).astype(np.float32)
                     for k, i in enumerate(distinct_ids)]
    g = tf.Graph()
    with g.as_default():
        lookup_ops, grad_ops = tf_comm._exchange_ops("lookup"), tf_comm._exchange_ops("grad")
        distinct_ops = tf_comm._exchange_ops("distinct")     # keys of its own per collective
        reuse_ops = tf_comm._exchange_ops("reuse")
        rows, got_v, got_i, reused_v, reused_i = [], [], [], [], []
        for k, s in enumerate(part.shards):
            with tf.device(s.device):
                var = tf.compat.v1.get_variable(
                    f"part_{k}", initializer=table[:, s.start:s.start + s.size], use_resource=True)
                for distinct, ops in ((False, lookup_ops), (True, distinct_ops)):
                    out = comm.lookup_columns(tf.constant(ids[k]), var.handle, k, part,
                                              tf.float32, *ops, distinct=distinct)
                    rows.append(out[0])
                v, i = comm.gradient_columns(tf.constant(grads[k]), tf.constant(ids[k]), k, part,
                                             True, *grad_ops)
                got_v.append(v)
                got_i.append(i)
                # rows of the distinct ids in first-seen order: the lookup's gathered
                # sizes and ids serve, nothing gathered again
                first = tf.constant(distinct_ids[k])
                v, i = comm.gradient_columns(tf.constant(distinct_rows[k]), first, k, part,
                                             False, *reuse_ops, sizes=out[1], every=out[2])
                reused_v.append(v)
                reused_i.append(i)
        init = tf.compat.v1.global_variables_initializer()
    with tf.compat.v1.Session(graph=g, config=session_config([("CPU", k) for k in range(3)])) as s:
        bounded = tf.compat.v1.RunOptions(timeout_in_ms=60_000)
        s.run(init)
        out_rows, out_v, out_i, out_rv, out_ri = s.run(
            [rows, got_v, got_i, reused_v, reused_i], options=bounded)
    for k in range(3):
        for got in out_rows[2 * k: 2 * k + 2]:
            np.testing.assert_array_equal(got, table[ids[k]])
        sh = part.shards[k]
        np.testing.assert_array_equal(out_i[k], np.concatenate(ids))
        np.testing.assert_allclose(out_v[k], np.concatenate(grads)[:, sh.start:sh.start + sh.size]
                                   / 3, rtol=1e-6)
        np.testing.assert_array_equal(out_ri[k], np.concatenate(distinct_ids))
        np.testing.assert_array_equal(out_rv[k], np.concatenate(distinct_rows)[
            :, sh.start:sh.start + sh.size])


def test_the_hosts_collectives_take_their_own_group_and_keys_in_call_order():
    from parallax_ng.comm import keys
    from parallax_ng.comm.lowering import host_lowering
    groups = [keys.JOB_GROUP, keys.WORKERS_GROUP, keys.HOSTS_GROUP, keys.BENCHMARK_GROUP]
    assert len(set(groups)) == len(groups)
    with pytest.raises(ConfigError, match="'communication.backend: horovod' does not apply"):
        host_lowering("horovod", 2, 0)
    with tf.Graph().as_default():
        sender, receiver = host_lowering("tf", 2, 0), host_lowering("tf", 2, 1)
        ops = [sender.all_reduce(tf.ones([3])).op, sender.broadcast(tf.ones([2])),
               receiver.all_reduce(tf.ones([3])).op, receiver.receive(tf.float32, [2]).op]
    assert [op.type for op in ops] == ["CollectiveReduce", "CollectiveBcastSend",
                                       "CollectiveReduce", "CollectiveBcastRecv"]
    assert {op.get_attr("group_key") for op in ops} == {keys.HOSTS_GROUP}
    assert [op.get_attr("instance_key") for op in ops] == [1, 2, 1, 2]
    assert {op.get_attr("group_size") for op in ops} == {2}


def test_a_later_graph_gives_the_same_collective_its_range_and_another_another():
    """Key ranges (a collective whose shape changes: its key is the range's
    first plus its size) are taken for what the collective is, across the
    graphs of one process: TensorFlow keeps a key's shape for as long as
    the process runs, so a tuned plan's factors must not meet the first
    graph's all-gather under one key."""
    from parallax_ng.comm.keys import RANGE_KEYS, RANGES_START, graph_keys
    ranges = {}
    first, later = graph_keys(0, ranges), graph_keys(1, ranges)
    rows = first.take_range("all_gather emb")
    assert rows == RANGES_START and first.take_range("all_gather emb indices") == \
        RANGES_START + RANGE_KEYS
    assert later.take_range("all_gather hidden/w factors") == RANGES_START + 2 * RANGE_KEYS
    assert later.take_range("all_gather emb") == rows           # the same collective
    assert first.take_range("all_gather emb") not in (rows, RANGES_START + RANGE_KEYS,
                                                      RANGES_START + 2 * RANGE_KEYS)
    assert later.take() == 1 + (1 << 20) and first.take() == 1  # single keys apart
    assert later.shared("parallax_ng/grads/0/1") == "parallax_ng/grads/0/1@graph1"
    assert first.shared("parallax_ng/grads/0/1") == "parallax_ng/grads/0/1"
