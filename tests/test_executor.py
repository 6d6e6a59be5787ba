"""The step executor: one run, or two at once (a job step's collectives and
its server work), and the job's barrier."""
import threading
import time

import numpy as np
import pytest
import tensorflow as tf

from models import embedding_regression
from parallax_ng.runtime.executor import Executor, SessionRun
from parallax_ng.pipeline.results import Barrier
from parallax_ng.pipeline.step_parts import COLLECTIVES, SERVERS, StepParts
from passkit import cluster_transform, context


def imported(ir):
    g = tf.Graph()
    with g.as_default():
        tf.graph_util.import_graph_def(ir.graph_def, name="")
    return g


def test_an_unstaged_step_is_one_session_run():
    ctx = context(n=2)
    ex = Executor.of(tf.Graph(), ctx)
    assert ex.runs(["loss:0", "train"]) == [SessionRun((0, 1))]
    assert ex.barrier is None


def test_a_split_step_is_two_runs_that_fetch_each_value_once():
    g, h = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, servers=1, dense_method="allreduce")
    graph = imported(ir)
    ex = Executor.of(graph, ctx)
    runs = ex.runs([h["train"].name, "loss:0"])
    assert len(runs) == 2
    assert sorted(i for r in runs for i in r.fetched) == [0, 1]
    assert [ex.parts.part_of_op(graph, r.targets[0]) for r in runs] == [SERVERS, COLLECTIVES]
    # the barrier is in the training step: no run of its own
    assert ex.barrier == Barrier(release="parallax/server_sync/release", folded=True)
    assert ex.barrier.op(0) == "parallax/server_sync/release" and ex.barrier.op(1) is None
    assert not ex.ends_with_barrier(initialized=False, trained=True)
    assert ex.ends_with_barrier(initialized=True, trained=False)


def two_parts(items: int):
    """A local graph cut by hand as split_step cuts a job's: part 0 reads an
    iterator of `items` elements and queues twice each; part 1 takes it,
    adds one and counts the steps in a variable."""
    g = tf.Graph()
    with g.as_default():
        it = tf.compat.v1.data.make_initializable_iterator(
            tf.data.Dataset.range(items).map(lambda x: tf.cast(x, tf.float32)))
        queue = tf.queue.FIFOQueue(1, [tf.float32], name="queue")
        enqueue = queue.enqueue(it.get_next() * 2.0, name="enqueue")
        taken = queue.dequeue(name="dequeue")
        count = tf.compat.v1.get_variable("count", initializer=0.0, use_resource=True)
        out = tf.identity(taken + 1.0, name="out")
        with tf.control_dependencies([taken]):
            step = count.assign_add(1.0, name="count_step")
        close = tf.group(queue.close(cancel_pending_enqueues=True), name="close")
        reset = tf.group(tf.raw_ops.DestroyResourceOp(resource=queue.queue_ref,
                                                      ignore_lookup_error=True), name="reset")
    floating = frozenset({"queue", "count"} | {op.name for op in g.get_operations()
                                               if op.type == "Const"})
    part_of = {op.name: COLLECTIVES for op in (taken.op, out.op, out.op.inputs[0].op, step.op)}
    part_of.update({op.name: SERVERS for op in g.get_operations()
                    if op.name not in part_of and op.name not in floating})
    parts = StepParts(part_of, floating, {"dequeue": "enqueue"}, ("queue",), close.name,
                      reset.name)
    ctx = context(n=1)
    ctx.publish(parts)
    return g, ctx, it


def test_two_runs_at_once_meet_at_their_queue():
    g, ctx, it = two_parts(5)
    ex = Executor.of(g, ctx, tf.compat.v1.RunOptions(timeout_in_ms=20000))
    with tf.compat.v1.Session(graph=g) as session:
        session.run([it.initializer, "count/Assign"])
        runs = ex.runs(["out:0", "count_step"])
        assert [r.targets for r in runs] == [("enqueue",), ("count_step", "dequeue", "out")]
        got = [ex.run(session, ["out:0"], {}) for _ in range(3)]
        assert got == [[1.0], [3.0], [5.0]]
        meta = tf.compat.v1.RunMetadata()
        options = tf.compat.v1.RunOptions(timeout_in_ms=20000,
                                          trace_level=tf.compat.v1.RunOptions.FULL_TRACE)
        ex.run(session, ["out:0"], {}, options=options, run_metadata=meta)
        traced = {ns.node_name for d in meta.step_stats.dev_stats for ns in d.node_stats}
        assert "enqueue" in traced and "out" not in traced   # the server part's run


def test_the_end_of_the_input_ends_both_runs_at_once_and_the_next_step_is_clean():
    """Part 0 reaches the end of its iterator while part 1 waits at the queue:
    the caller gets OutOfRangeError at once (not after the timeout), part 1
    did nothing, and after the iterator starts again steps go on as before,
    with no element left over."""
    g, ctx, it = two_parts(2)
    ex = Executor.of(g, ctx, tf.compat.v1.RunOptions(timeout_in_ms=60000))
    with tf.compat.v1.Session(graph=g) as session:
        session.run([it.initializer, "count/Assign"])
        for epoch in range(3):
            values = []
            start = time.monotonic()
            with pytest.raises(tf.errors.OutOfRangeError):
                while True:
                    values.append(ex.run(session, ["out:0", "count_step"], {})[0])
            assert time.monotonic() - start < 10
            assert values == [1.0, 3.0]
            assert session.run("count/Read/ReadVariableOp:0") == 2.0 * (epoch + 1)
            session.run(it.initializer)
        assert threading.active_count() < 5


def test_a_failing_collective_run_stops_the_server_run():
    """Part 1 fails (a bad value): the caller gets its error at once, and
    the next step takes the next element."""
    g, ctx, it = two_parts(5)
    before = set(g.get_operations())
    with g.as_default():
        tf.debugging.check_numerics(
            tf.math.log(g.get_tensor_by_name("dequeue:0") - 100.0), "negative", name="checked")
    ctx.result(StepParts).part_of.update(
        {op.name: COLLECTIVES for op in set(g.get_operations()) - before})
    ex = Executor.of(g, ctx, tf.compat.v1.RunOptions(timeout_in_ms=60000))
    with tf.compat.v1.Session(graph=g) as session:
        session.run([it.initializer, "count/Assign"])
        start = time.monotonic()
        with pytest.raises(tf.errors.InvalidArgumentError, match="negative"):
            ex.run(session, ["checked:0"], {})
        assert time.monotonic() - start < 10
        assert np.isclose(ex.run(session, ["out:0"], {})[0], 3.0)   # the next element


def test_a_step_without_collectives_holds_its_barrier():
    g, h = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, servers=1, dense_method="bfb")
    ex = Executor.of(imported(ir), ctx)
    assert len(ex.runs([h["train"].name])) == 1 and ex.barrier.folded
    assert ex.ends_with_barrier(initialized=True, trained=False)
    assert not ex.ends_with_barrier(initialized=False, trained=True)


def test_other_workers_wait_at_the_barrier():
    g, _ = embedding_regression(4, "adam")
    ir, ctx = cluster_transform(g, worker=1, servers=1)
    ex = Executor.of(imported(ir), ctx)
    assert ex.barrier.op(1) == "parallax/server_sync/wait"
    assert ex.graph.get_operation_by_name(ex.barrier.op(1)).type == "QueueDequeueV2"


def test_a_run_that_times_out_in_an_exchange_says_every_worker_makes_the_same_runs():
    """Replica 0's all-reduced gradient run by itself (as a job's worker 0
    alone would run it) waits for replica 1 until the run's timeout; the
    error says which run, the timeout's key, and that every worker must
    make the same runs. A run that meets no other replica says only to
    raise the timeout."""
    import parallax_ng as pn
    from models import local
    g, h = embedding_regression(4, "sgd")
    config = {"run_option": "allreduce", "communication": {"timeout_seconds": 2}}
    with pn.get_runner(g, local(2), config) as runner:
        runner.run([h["init"], h["iterator_init"]])
        reduced = [op.outputs[0].name for op in runner.graph.get_operations()
                   if op.type.startswith("CollectiveReduce") and "replica_1" not in op.name and
                   op.device.endswith("CPU:0")]
        with pytest.raises(tf.errors.DeadlineExceededError) as caught:
            runner.executor.run(runner.session, reduced[:1], {})
        said = caught.value.message
        assert f"run of {reduced[:1]} did not end within communication.timeout_seconds (2 s)" \
            in said and "every worker must make the same runs" in said
        assert runner.executor._timed_out(["dense/w/Read/ReadVariableOp:0"], runner.executor
                                          .options).endswith("raise it if a step takes that long")


@pytest.mark.parametrize("run_option", ["hybrid", "ps"])
def test_a_run_that_trains_nothing_but_reads_gradients_the_servers_apply_is_refused(run_option):
    """A job with a server: the gradients' global norm fetched alone would
    take a part of a training step's exchange on worker 0 (the workers got
    different norms, and the next step waited until the timeout), so every
    worker refuses it alike, naming the variable and the forms that work.
    The loss alone (an evaluation) is allowed, and so is a norm of
    gradients exchanged by fusion buffers, which every worker takes back
    (hybrid: the embedding's on the server, the dense ones by buffers)."""
    from parallax_ng.errors import FetchError
    from parallax_ng.runtime.one_replica import refuse_untrained
    g, h = embedding_regression(4, "adam", clip=True)
    for worker in (0, 1):
        ir, ctx = cluster_transform(g, worker=worker, servers=1, run_option=run_option)
        reached = ctx.tg.ir.ancestors(["global_norm/global_norm"])
        with pytest.raises(FetchError, match="trains nothing but reads the gradient of "
                           f"'{'emb' if run_option == 'hybrid' else 'dense/b'}'.*"
                           r"runner.run\(\[train_op, value\]\)"):
            refuse_untrained(ctx.tg, ctx.plan, reached)
        refuse_untrained(ctx.tg, ctx.plan, ctx.tg.ir.ancestors(["loss"]))
        dense = {v: vp.method for v, vp in ctx.plan.variables.items() if v != "emb"}
        if run_option == "hybrid":
            assert set(dense.values()) == {"bfb"}
            grads = {ctx.tg.gradients[v].values.node for v in dense}
            refuse_untrained(ctx.tg, ctx.plan, ctx.tg.ir.ancestors(grads))
