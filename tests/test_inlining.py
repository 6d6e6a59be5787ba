"""A traced step's calls inlined (graph/inlining.py): functions compiled by
XLA or marked not to be inlined are opened like the others, and what the
tapes differentiated keeps its name; pn.function steps with such helpers
equal one device."""
import numpy as np
import pytest
import tensorflow as tf
from models import local

import parallax_ng as pn
from parallax_ng.graph import inlining

CALLS = ("PartitionedCall", "StatefulPartitionedCall")


@pytest.mark.parametrize("marks", [{"jit_compile": True},
                                   {"experimental_attributes": {"_noinline": True}}])
def test_marked_calls_are_inlined_and_a_kept_output_keeps_its_name(marks):
    w = tf.Variable(tf.ones((3, 1)))

    @tf.function(**marks)
    def loss_of(p, y):
        return tf.reduce_sum(tf.square(p - y))

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = loss_of(x @ w, y)
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss
    specs = (tf.TensorSpec([None, 3]), tf.TensorSpec([None, 1]))
    concrete = tf.function(step).get_concrete_function(*specs)
    call = [op.name for op in concrete.graph.get_operations() if op.type in CALLS][0]
    graph_def = inlining.inlined(concrete, keep=[f"{call}:0"])
    ops = {n.name: n.op for n in graph_def.node}
    assert not [name for name, op in ops.items() if op in CALLS]
    assert ops[call] == "IdentityN"        # the call's output, by its name
    assert "Sum" in ops.values() and "AssignSubVariableOp" in ops.values()


def test_a_stateful_call_only_run_becomes_a_noop_after_its_outputs():
    """A stateful call among the step's control outputs whose outputs no
    op reads (an update in a nested function that returns its new value)
    is left by the inliner as an IdentityN of every output: made a NoOp
    after the same ops, it reads none of them (a fused batch
    normalization's reserve spaces stay its gradient's alone)."""
    w = tf.Variable(tf.ones((3,)))

    @tf.function
    def update(g):
        w.assign_sub(g)
        return w.read_value(), 2.0 * g

    def step(g):
        update(g)
        return tf.reduce_sum(g)
    concrete = tf.function(step).get_concrete_function(tf.TensorSpec([3]))
    calls = [op.name for op in concrete.graph.control_outputs if op.type in CALLS]
    graph_def = inlining.inlined(concrete)
    nodes = {n.name: n for n in graph_def.node}
    assert calls and all(nodes[c].op == "NoOp" for c in calls)
    assert all(i.startswith("^") for c in calls for i in nodes[c].input) and nodes[calls[0]].input
    read = {i.split(":")[0] for n in graph_def.node for i in n.input if not i.startswith("^")}
    assert not read & set(calls)
    assert "AssignSubVariableOp" in {n.op for n in graph_def.node}


def _steps(where: str, jit: bool):
    """A model, an SGD with momentum and a step whose loss (a sum over the
    batch divided by a constant), forward pass or update is in a nested
    tf.function (compiled by XLA where `jit`)."""
    w = tf.Variable(np.random.default_rng(1).normal(size=(4, 1)).astype(np.float32))
    opt = tf.keras.optimizers.SGD(0.1, momentum=0.9)

    @tf.function(jit_compile=jit)
    def summed(p, y):
        return tf.reduce_sum(tf.square(p - y)) / 16.0

    @tf.function(jit_compile=jit)
    def forward(x):
        return tf.tanh(x @ w)

    @tf.function(jit_compile=jit)
    def update(g):
        w.assign_sub(0.1 * g)

    def step(x, y):
        with tf.GradientTape() as tape:
            loss = summed(x @ w, y) if where == "loss" else \
                tf.reduce_mean(tf.square((forward(x) if where == "forward" else x @ w) - y))
        g = tape.gradient(loss, w)
        if where == "update":
            update(g)
        else:
            opt.apply_gradients([(g, w)])
        return loss
    return w, opt, step


@pytest.mark.parametrize("jit", [True, False], ids=["jit", "plain"])
@pytest.mark.parametrize("where", ["loss", "forward", "update"])
def test_a_step_with_a_nested_function_equals_one_device(where, jit, capsys):
    """Before: a summed loss in a nested function was not found (its call's
    name was gone after inlining): the gradients were averaged, silently,
    0.48 apart after 5 steps; a jit function's reads and writes were not
    inlined at all (0.23 apart, and a refusal for the update)."""
    rng = np.random.default_rng(0)
    xs = rng.normal(size=(5, 16, 4)).astype(np.float32)
    ys = rng.normal(size=(5, 16, 1)).astype(np.float32)
    (wa, _, sa), (wb, _, sb) = _steps(where, jit), _steps(where, jit)
    parallel, single = pn.function(sa, local(2)), tf.function(sb)
    for x, y in zip(xs, ys):
        la, lb = parallel(x, y), single(x, y)
    parallel.sync()
    np.testing.assert_allclose(wa.numpy(), wb.numpy(), atol=1e-6, rtol=0)
    np.testing.assert_allclose(float(la), float(lb), atol=1e-6, rtol=0)
    assert "parallax_ng" not in capsys.readouterr().err


@tf.custom_gradient
def _clipped(x):
    return tf.identity(x), lambda dy: tf.clip_by_value(dy, -0.01, 0.01)


@pytest.mark.parametrize("reduce,warned", [(tf.reduce_mean, True), (tf.reduce_sum, False)])
def test_a_bent_custom_gradient_in_a_nested_function_is_named(reduce, warned, capsys):
    """A clip by value in a tf.custom_gradient inside a nested function:
    its gradient is inlined as `PartitionedCall/gradients/IdentityN_grad/`
    while its forward op is `StatefulPartitionedCall/IdentityN`. Before,
    the clip was not found: with a mean loss the step trained 0.0135 off
    one device after 4 steps in float64, without a word (in the step
    itself it was named)."""
    w = tf.Variable(np.ones((3, 2)))
    forward = tf.function(lambda x: _clipped(tf.tanh(x @ w)))

    def step(x):
        with tf.GradientTape() as tape:
            loss = reduce(tf.square(forward(x)))
        w.assign_sub(0.1 * tape.gradient(loss, w))
        return loss
    pn.function(step, local(2))(np.ones((4, 3)))
    said = capsys.readouterr().err
    assert ("is not linear in the gradient it receives" in said) is warned, said
    if warned:
        assert "'PartitionedCall/gradients/IdentityN_grad/clip_by_value/Minimum'" in said


def test_a_lowered_loops_ops_keep_their_traced_shapes():
    """An import of the inlined graph infers no shape after a lowered
    loop's Merge ops (it reads the Merge before the value the body passes
    back), so every op in a TF2 step's loop had an unknown rank: a batch's
    statistic there went unnamed (tests/test_extremes.py). The body's ops
    take their traced shapes (`body_shapes`, taken off the GraphDef), the
    loop's own ops those of what enters and comes back (`loop_shapes`): a
    variable that keeps its shape keeps it; one declared to grow (a shape
    invariant) takes the shape compatible with both."""
    from parallax_ng.graph import tracing
    w = tf.Variable(tf.ones((3, 1)))

    def step(x):
        def body(i, acc, rows):
            xs = x * (1.0 + tf.cast(i, tf.float32))
            top = tf.reduce_max(tf.abs(xs), name="top")
            return i + 1, acc + tf.matmul(xs / top, w), tf.concat([rows, xs[:1]], 0)
        _, out, rows = tf.while_loop(
            lambda i, *_: i < 2, body, [tf.constant(0), tf.zeros_like(x[:, :1]), x[:0]],
            shape_invariants=[tf.TensorShape([]), tf.TensorShape([None, 1]),
                              tf.TensorShape([None, 3])])
        w.assign_sub(tf.reduce_mean(out) * tf.ones((3, 1)) + tf.reduce_sum(rows))
        return out
    concrete = tf.function(step).get_concrete_function(tf.TensorSpec([None, 3]))
    graph_def = inlining.inlined(concrete)
    shapes = inlining.body_shapes(graph_def)
    assert shapes and not [n.name for n in graph_def.node if "_output_shapes" in n.attr]
    top = [name for name in shapes if name.endswith("/top")][0]
    assert shapes[top] == ("Max", [tf.TensorShape([])])

    captured = tracing.capture(step, (np.ones((4, 3), np.float32),))
    ops = captured.graph.get_operations()
    top = [op for op in ops if op.name.endswith("/top")][0]
    assert top.inputs[0].shape.as_list() == [None, 3]      # before: unknown rank
    merged = sorted(op.outputs[0].shape.as_list() for op in ops if op.type == "Merge")
    exits = sorted(op.outputs[0].shape.as_list() for op in ops if op.type == "Exit")
    # counters and the loop's variables: i, acc kept, rows grown (entering with 0 rows)
    assert [None, 1] in merged and [None, 3] in merged and [0, 3] not in merged
    assert [None, 1] in exits and [None, 3] in exits
    assert all(op.outputs[0].shape.rank is not None for op in ops
               if op.type in ("Merge", "Switch", "Exit", "NextIteration"))
