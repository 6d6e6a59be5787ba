"""The step barrier of a job whose variables live on servers
(transforms/step_barrier.py), read off the generated graphs; the jobs
that run it are in test_server_sync.py, test_cluster.py and, for updates
under a tf.cond, test_branches.py."""
import pytest

from models import counting_graph
from passkit import cluster_transform
from transforms import step_barrier
from transforms.step_barrier import RELEASE, WAIT


def controls(node) -> set[str]:
    return {i[1:] for i in node.input if i.startswith("^")}


def test_the_chiefs_token_follows_each_writer_the_training_run_has():
    """An update outside any branch: the chief's token for worker 1 waits
    on the writer itself, and what followed the writer waits on the
    token; worker 1's silenced writer takes it."""
    g, _ = counting_graph("fed")
    ir, ctx = cluster_transform(g, worker=0, run_option="ps")
    writers = step_barrier.writers(ctx)
    assert writers == ["train/update_w/ResourceApplyGradientDescent"]
    put = ir.node("parallax/server_sync/step_0_1/put")
    assert controls(put) == set(writers)
    assert any("parallax/server_sync/step_0_1/put" in controls(ir.node(c))
               for c in ir.node_consumers[writers[0]])
    assert ir.node(RELEASE).op == "NoOp" and WAIT not in ir
    ir1, _ = cluster_transform(counting_graph("fed")[0], worker=1, run_option="ps")
    take = ir1.node("parallax/server_sync/step_0/take")
    assert take.op == "QueueDequeueV2" and "parallax/server_sync/push_0" in controls(take)
    assert ir1.node(writers[0]).op == "NoOp"
    assert "parallax/server_sync/step_0/take" in controls(ir1.node(writers[0]))


@pytest.mark.parametrize("kind", ["v1", "v2"])
def test_a_token_for_an_update_under_a_cond_waits_where_the_cond_ends(kind):
    """The update applied under a fed tf.cond (v1's Switch/Merge, or an If
    the front end lowers): the chief's token waits on the Merges after the
    writer, which run whether the branch did or not (after the writer it
    was never put in a step that skipped it, and worker 1, which takes one
    every step, waited until the timeout). The gradients the branch
    computes move through a queue of their own, whose take on the chief
    waits on the chief's own part (dead in a skipped step)."""
    from test_branches import conds
    with conds(kind):
        g, _ = counting_graph("fed", applied=True)
    ir, ctx = cluster_transform(g, worker=0, run_option="ps")
    (writer,) = [w for w in ctx.tg.writers["w"] if w in ctx.tg.after_gradients]
    ends = step_barrier.ends(ctx, [writer])[writer]
    if kind == "v1":    # the cond ends in the op the script fetches: no Merge follows the
        assert step_barrier.writers(ctx) is None    # writer to hang the token on: the
    else:                                           # barrier is a run of its own
        assert ends and writer not in ends
        assert all(ir.node(e).op == "Merge" for e in ends)
        assert step_barrier.writers(ctx) == [writer]
        assert controls(ir.node("parallax/server_sync/step_0_1/put")) == set(ends)
    take = ir.node("parallax/server_sync/take_0b0_1")
    assert take.op == "QueueDequeueV2" and controls(take)
    assert "parallax/server_sync/take_0_1" not in ir
    with conds(kind):
        g1, _ = counting_graph("fed", applied=True)
    ir1, _ = cluster_transform(g1, worker=1, run_option="ps")
    assert ir1.node("parallax/server_sync/push_0b0").op == "QueueEnqueueV2"
    if kind == "v2":
        take1 = ir1.node("parallax/server_sync/step_0/take")
        assert "parallax/server_sync/push_0b0" not in controls(take1)   # dead where skipped
