"""Split step: a job step's collectives and its parameter-server work in two
session runs at once, joined by this worker's queues
(transforms/split_step.py, parallax_ng/pipeline/step_parts.py)."""
import threading

import pytest
import tensorflow as tf

from models import embedding_regression
from passkit import cluster_transform
from parallax_ng.graph import emit
from parallax_ng.errors import FetchError, GraphError
from parallax_ng.graph.ir import GraphIR
from parallax_ng.pipeline.step_parts import COLLECTIVES, SERVERS, StepParts
from transforms.split_step import COLLECTIVE_OPS, _number, on_server

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
def test_each_run_has_collectives_or_server_work_never_both(worker):
    g, h = embedding_regression(4, "adam", clip=True, ema=True)
    ir, ctx = cluster_transform(g, worker=worker, devices=2, dense_method="allreduce")
    parts = ctx.result(StepParts)
    graph = imported(ir)
    for fetch in (h["train"].name, h["init"].name):
        runs = parts.split(graph, (fetch,))
        assert [p for p, _ in runs] == [SERVERS, COLLECTIVES]
        ran = {}
        for part, targets in runs:
            ops = pruned(graph, targets) - parts.floating
            assert not ops & set(ran), "an op would run in both runs"
            ran.update(dict.fromkeys(ops, part))
            kinds = {("collective" if graph.get_operation_by_name(o).type in COLLECTIVE_OPS
                      else "server" if on_server(graph.get_operation_by_name(o).device)
                      else "local") for o in ops}
            if fetch == h["train"].name:
                assert kinds >= {"collective" if part else "server"}
            assert not {"collective", "server"} <= kinds, (part, kinds)
            assert all(parts.part_of[o] == part for o in ops)
        # every queue a run takes from, the other run fills, in the same step
        for deq, enq in parts.enqueue_of.items():
            if deq in ran:
                assert ran[enq] == 1 - ran[deq]
    for q in parts.queues:
        node = ir.node(q)
        assert node.op == "FIFOQueueV2" and node.attr["capacity"].i == 1
        assert node.attr["shared_name"].s == b""           # this session's own
        assert node.device.startswith(f"/job:worker/replica:0/task:{worker}/")
    # a control edge across runs became a token through a queue
    assert any(q.endswith("/token_queue") for q in parts.queues)


def test_the_chief_reads_the_clip_scale_from_the_collective_run():
    """The global norm needs the all-reduced dense gradients; the embedding's
    update on the server waits for it through a queue, in the same step."""
    g, h = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, dense_method="allreduce")
    parts = ctx.result(StepParts)
    deqs = [d for d, e in parts.enqueue_of.items()
            if parts.part_of[d] == SERVERS and parts.part_of[e] == COLLECTIVES]
    assert deqs, "nothing goes from the collectives back to the server work"
    assert ir.node(parts.close).op == "NoOp" and ir.node(parts.reset).op == "NoOp"
    closes = [ir.node(c[1:]) for c in ir.node(parts.close).input]
    assert {c.op for c in closes} == {"QueueCloseV2"}
    assert all(c.attr["cancel_pending_enqueues"].b for c in closes)
    drops = [ir.node(c[1:]) for c in ir.node(parts.reset).input]
    assert {d.op for d in drops} == {"DestroyResourceOp"}
    assert len(closes) == len(drops) == len(parts.queues)


def test_queues_of_gpu_replicas_are_on_their_task_cpu():
    g, _ = embedding_regression(4, "momentum", clip=True)
    from parallax_ng.cluster import ClusterInfo
    import parallax_ng as pn
    info = ClusterInfo(("127.0.0.1:2000", "127.0.0.1:2001"), ("127.0.0.1:3000",), "worker", 1,
                       (("GPU", 0), ("GPU", 1)))
    ir, ctx, _ = pn.transform(g, config={"run_option": "hybrid", "dense_method": "allreduce"},
                              cluster_info=info)
    parts = ctx.result(StepParts)
    queue_ops = {"FIFOQueueV2", "QueueEnqueueV2", "QueueDequeueV2", "QueueCloseV2",
                 "DestroyResourceOp"}
    placed = [n for n in ir.nodes if n.name.startswith("parallax/split_step/")
              and n.op in queue_ops]
    assert placed and {n.device for n in placed} == {
        "/job:worker/replica:0/task:1/device:CPU:0"}
    assert any("GPU" in ir.node(deq).device or "GPU" in ir.node(c).device
               for deq in parts.enqueue_of
               for c in ir.node_consumers.get(deq, ())), "no GPU op reads a dequeue"
    assert len(parts.queues) >= 2


def test_jobs_without_parameter_servers_are_one_run_per_step():
    g, _ = embedding_regression(4, "adam", clip=True)
    _, ctx = cluster_transform(g, worker=0, servers=0, run_option="allreduce")
    assert ctx.result(StepParts) is None


def test_fusion_buffers_leave_the_training_step_one_run():
    """Dense sums on the servers: no collective in the training step (the
    initial values' broadcast still runs beside the servers' initializers)."""
    g, h = embedding_regression(4, "adam", clip=True)
    ir, ctx = cluster_transform(g, worker=0, dense_method="bfb")
    parts, graph = ctx.result(StepParts), imported(ir)
    assert [p for p, _ in parts.split(graph, (h["train"].name,))] == [SERVERS]
    assert [p for p, _ in parts.split(graph, (h["init"].name,))] == [SERVERS, COLLECTIVES]


def test_an_op_made_later_that_reads_both_runs_is_refused():
    g = tf.Graph()
    with g.as_default():
        a = tf.constant(1.0, name="a")
        b = tf.identity(a, name="b")
        c = tf.identity(a, name="c")
        tf.add(b, c, name="late")
        tf.identity(b, name="late_one")
    parts = StepParts({"b": SERVERS, "c": COLLECTIVES}, frozenset({"a"}))
    with pytest.raises(FetchError, match="'late' was made after get_runner"):
        parts.split(g, ("late",))
    assert parts.split(g, ("late_one",)) == [(SERVERS, ["late_one"])]


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


def _cond_graph(then_device: str):
    """A worker's cond: if `inited`, the then branch reads `v` (an op on
    `then_device`), else it takes an all-reduce; the Merge after it."""
    worker = "/job:worker/replica:0/task:0/device:CPU:0"
    f32 = tf.float32
    nodes = [emit.node_def("v", "VarHandleOp", [], worker, dtype=f32, shape=tf1.AttrValue(
                 shape=tf.TensorShape([]).as_proto()), shared_name="v"),
             emit.node_def("inited", "VarIsInitializedOp", ["v"], worker),
             emit.const("x", 1.0, f32, worker),
             emit.collective_reduce("sum", "x", f32, worker, group_size=2, group_key=1,
                                    instance_key=1, mean=False, timeout=10.0),
             emit.node_def("then/switch", "Switch", ["v", "inited"], worker, T=tf.resource),
             emit.node_def("then/read", "ReadVariableOp", ["then/switch:1"], then_device,
                           dtype=f32),
             emit.node_def("else/switch", "Switch", ["sum", "inited"], worker, T=f32),
             emit.node_def("merge", "Merge", ["else/switch", "then/read"], worker, T=f32, N=2),
             emit.node_def("after", "Identity", ["merge"], worker, T=f32)]
    return GraphIR(nodes=nodes, versions=tf1.GraphDef().versions)


def test_a_conditional_branch_runs_whole_in_one_run():
    """A branch not taken is dead: a queue it would fill stays empty, and the
    other run would wait at it for good (the init of a table cut by columns
    in a job with servers hung so). The branch's ops follow its Merge into
    the collective run; what it reads before the Switch crosses, live."""
    ir = _cond_graph("/job:worker/replica:0/task:0/device:CPU:0")
    stage = _number(ir, {"v", "x"})
    assert {stage[n] % 2 for n in ("then/switch", "then/read", "merge")} == {COLLECTIVES}
    assert stage["inited"] % 2 == SERVERS
    ps_read = _cond_graph("/job:ps/replica:0/task:0/device:CPU:0")
    with pytest.raises(GraphError, match="conditional branch .* both collective ops and "
                                         "parameter-server ops"):
        _number(ps_read, {"v", "x"})


def test_a_dequeue_runs_even_where_tensorflow_rewrites_its_reader_away():
    """A shape that crosses runs feeds a Reshape that TensorFlow's graph
    rewrites may fold into the Reshape after it (an alltoall lookup's rows,
    then the model's own reshape): the folded Reshape no longer reads the
    dequeue, and the run would not take the element the other run put,
    so the next step's put waited for good (lm_small's job in
    test_examples.py hung so at step 2). Dequeues are targets of their
    run, so they run whatever reads them; two steps in a row end empty."""
    g = tf.Graph()
    with g.as_default():
        q = tf.queue.FIFOQueue(1, [tf.int32], name="q")
        shape = tf.constant([4, 2], name="shape")
        q.enqueue([shape], name="enq")
        rows = tf.reshape(tf.range(8.0, name="x"), q.dequeue(name="deq"), name="inner")
        tf.reshape(tf.identity(rows, name="rows"), [2, 4], name="outer")
    parts = StepParts({"shape": SERVERS, "enq": SERVERS, "deq": COLLECTIVES,
                       "x": COLLECTIVES, "inner": COLLECTIVES, "rows": COLLECTIVES,
                       "outer": COLLECTIVES}, frozenset({"q"}), {"deq": "enq"})
    runs = dict(parts.split(g, ("outer",)))
    assert "deq" in runs[COLLECTIVES] and runs[SERVERS] == ["enq"]
    bounded = tf1.RunOptions(timeout_in_ms=10000)
    with tf1.Session(graph=g) as sess:
        for _ in range(2):
            put = threading.Thread(target=sess.run, args=(runs[SERVERS],),
                                   kwargs={"options": bounded})
            put.start()
            got = sess.run(["outer:0"] + [t for t in runs[COLLECTIVES] if t != "outer"],
                           options=bounded)[0]
            put.join(timeout=20)
            assert not put.is_alive()
            assert got.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert sess.run(q.size()) == 0


def test_only_the_inputs_of_an_identityn_s_outputs_read_are_needed():
    """TensorFlow prunes an IdentityN's inputs whose outputs nothing in the
    run reads (Keras's clipped gradients: one IdentityN of them all, whose
    embedding output a non-chief worker never reads). The split must not
    run the enqueue of such an input's queue: nothing would take the
    element, and the next step's enqueue would wait forever."""
    g = tf.Graph()
    with g.as_default():
        q = tf.queue.FIFOQueue(1, [tf.float32], name="q")
        sent = tf.constant(2.0, name="sent")
        q.enqueue([sent], name="enq")
        taken = q.dequeue(name="deq")
        kept = tf.constant(1.0, name="kept")
        both = tf.raw_ops.IdentityN(input=[kept, taken], name="clipped")
        tf.identity(both[0], name="first")
        tf.identity(both[1], name="second")
    parts = StepParts({"sent": SERVERS, "enq": SERVERS, "deq": COLLECTIVES,
                       "kept": COLLECTIVES, "clipped": COLLECTIVES, "first": COLLECTIVES,
                       "second": COLLECTIVES}, frozenset({"q"}), {"deq": "enq"})
    assert parts.split(g, ("first",)) == [(COLLECTIVES, ["first"])]
    assert parts.split(g, ("second",)) == [(SERVERS, ["enq"]), (COLLECTIVES, ["deq", "second"])]
    assert parts.split(g, ("clipped",)) == [(SERVERS, ["enq"]), (COLLECTIVES, ["clipped", "deq"])]


def test_a_loop_between_a_collective_and_server_work_runs_whole():
    """A while loop (control flow v1) with neither collectives nor server
    ops that reads a collective's output and feeds server work (a recurrent
    layer's gradient loop between an alltoall lookup and fusion buffers):
    its counter starts from a constant (the first stage) and its body adds
    the collective's sum (the second), so op by op the loop had ops of both
    runs and was refused. It now runs whole in the collectives' run, and
    the server's read of its result in the run after."""
    worker = "/job:worker/replica:0/task:0/device:CPU:0"
    ps = "/job:ps/replica:0/task:0/device:CPU:0"
    f32 = tf.float32
    nodes = [emit.const("x", 1.0, f32, worker), emit.const("zero", 0.0, f32, worker),
             emit.const("limit", 3.0, f32, worker),
             emit.collective_reduce("sum", "x", f32, worker, group_size=2, group_key=1,
                                    instance_key=1, mean=False, timeout=10.0),
             emit.node_def("enter", "Enter", ["zero"], worker, T=f32, frame_name="loop"),
             emit.node_def("enter_sum", "Enter", ["sum"], worker, T=f32, frame_name="loop",
                           is_constant=True),
             emit.node_def("enter_limit", "Enter", ["limit"], worker, T=f32,
                           frame_name="loop", is_constant=True),
             emit.node_def("merge", "Merge", ["enter", "next"], worker, T=f32, N=2),
             emit.node_def("less", "Less", ["merge", "enter_limit"], worker, T=f32),
             emit.node_def("cond", "LoopCond", ["less"], worker),
             emit.node_def("switch", "Switch", ["merge", "cond"], worker, T=f32),
             emit.node_def("body", "Identity", ["switch:1"], worker, T=f32),
             emit.node_def("add", "AddV2", ["body", "enter_sum"], worker, T=f32),
             emit.node_def("next", "NextIteration", ["add"], worker, T=f32),
             emit.node_def("exit", "Exit", ["switch"], worker, T=f32),
             emit.node_def("on_ps", "Identity", ["exit"], ps, T=f32)]
    ir = GraphIR(nodes=nodes, versions=tf1.GraphDef().versions)
    stage = _number(ir, {"x", "zero", "limit"})
    loop = ["enter", "enter_sum", "enter_limit", "merge", "less", "cond", "switch", "body",
            "add", "next", "exit"]
    assert {stage[n] for n in loop} == {stage["sum"]} and stage["sum"] % 2 == COLLECTIVES
    assert stage["on_ps"] == stage["sum"] + 1 and stage["on_ps"] % 2 == SERVERS
