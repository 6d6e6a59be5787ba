from parallax_ng.config import BucketsConfig
from passkit import HOST, context, devices, op_counts, run_passes
from transforms.aggregate import AggregatePass
from transforms.replicate import ReplicatePass


def aggregated(n=2, **cfg):
    ctx = context(n=n, **cfg)
    return ctx, run_passes(ctx, ReplicatePass(), AggregatePass())


PER_VARIABLE = BucketsConfig(mode="none")      # one all-reduce per variable


def test_hybrid_allreduces_dense_and_sums_sparse_on_the_host():
    ctx, ir = aggregated(n=3, run_option="hybrid", buckets=PER_VARIABLE)
    reduces = [n for n in ir.nodes if n.op == "CollectiveReduce"]
    assert len(reduces) == 3 * 3          # three dense variables, three replicas
    by_var = {}
    for nd in reduces:
        by_var.setdefault(nd.name.split("/replica_")[0], []).append(nd)
    for nodes in by_var.values():
        assert {nd.attr["instance_key"].i for nd in nodes} .__len__() == 1
        assert sorted(nd.device for nd in nodes) == devices(3)
        assert all(nd.attr["group_size"].i == 3 and nd.attr["final_op"].s == b"Div"
                   for nd in nodes)
    keys = {nodes[0].attr["instance_key"].i for nodes in by_var.values()}
    assert len(keys) == 3                  # one instance per variable
    ps = op_counts(ir, "parallax/ps/emb")
    assert ps["ConcatV2"] == 2 and ps["Mul"] == 1
    assert all(n.device == HOST for n in ir.nodes if n.name.startswith("parallax/ps/"))


def test_the_dense_gradients_are_merged_into_one_all_reduce_by_default():
    """Buckets of 4 MiB (the default threshold): the three small dense
    variables go in one, packed flat on every replica, reduced once, split
    back to every replica's update."""
    ctx, ir = aggregated(n=3, run_option="hybrid")
    assert [b.variables for b in ctx.plan.buckets] == [("out/v", "dense/b", "dense/w")]
    reduces = [n for n in ir.nodes if n.op == "CollectiveReduce"]
    assert sorted(n.name for n in reduces) == [f"parallax/bucket_0/reduce/replica_{k}"
                                               for k in range(3)]
    assert len({n.attr["instance_key"].i for n in reduces}) == 1
    apply1 = ir.node("parallax/replica_1/GradientDescent/update_dense/w/"
                     "ResourceApplyGradientDescent")
    assert apply1.input[2] == "parallax/bucket_0/replica_1/out_2"


def test_every_consumer_in_every_replica_reads_the_aggregate():
    ctx, ir = aggregated(n=2, run_option="hybrid", buckets=PER_VARIABLE)
    grad = str(ctx.tg.gradients["dense/w"].values).removesuffix(":0")
    apply0 = ir.node("GradientDescent/update_dense/w/ResourceApplyGradientDescent")
    apply1 = ir.node("parallax/replica_1/GradientDescent/update_dense/w/"
                     "ResourceApplyGradientDescent")
    assert apply0.input[2] == "parallax/allreduce/dense/w/replica_0"
    assert apply1.input[2] == "parallax/allreduce/dense/w/replica_1"
    assert ir.node("parallax/allreduce/dense/w/replica_1").input == [
        "parallax/replica_1/" + grad]
    scatter = ir.node("GradientDescent/update_emb/ResourceScatterAdd")
    assert scatter.input[1] == "parallax/ps/emb/distinct"   # each distinct row once


def test_sum_instead_of_mean():
    _, ir = aggregated(n=2, run_option="hybrid", average_dense=False, average_sparse=False)
    assert {n.attr["final_op"].s for n in ir.nodes if n.op == "CollectiveReduce"} == {b"Id"}
    assert op_counts(ir, "parallax/ps/")["Mul"] == 0


def test_ps_mode_aggregates_dense_with_addn():
    _, ir = aggregated(n=2, run_option="ps")
    assert op_counts(ir)["CollectiveReduce"] == 0
    assert op_counts(ir, "parallax/ps/dense/w")["AddN"] == 1


def test_allreduce_mode_gathers_sparse_gradients():
    _, ir = aggregated(n=2, run_option="allreduce")
    gathers = op_counts(ir, "parallax/allgather/emb/")["CollectiveGatherV2"]
    assert gathers == 2 * 2               # per replica sizes, then values and indices as words
    assert op_counts(ir)["CollectiveReduce"] == 1 * 2   # the dense variables' bucket x replicas
    assert all(n.device.endswith("CPU:1") for n in ir.nodes
               if n.name.startswith("parallax/allgather/emb/replica_1/"))


def test_golden_tiny_graph():
    """One dense variable on two devices: exactly one all-reduce per replica,
    read by that replica's update."""
    from passkit import tiny_graph
    ctx = context(n=2, graph=tiny_graph(), run_option="allreduce")
    ir, _ = ReplicatePass().run(ctx.tg.ir, ctx)
    out, report = AggregatePass().run(ir, ctx)
    added = sorted(n.name for n in out.nodes if n.name not in ir)
    assert added == ["parallax/allreduce/w/replica_0", "parallax/allreduce/w/replica_1"]
    for k in range(2):
        node = out.node(f"parallax/allreduce/w/replica_{k}")
        assert node.op == "CollectiveReduce" and node.device == devices(2)[k]
        assert node.attr["group_size"].i == 2 and node.attr["final_op"].s == b"Div"
    update = "train/update_w/ResourceApplyGradientDescent"
    assert out.node(update).input[2] == "parallax/allreduce/w/replica_0"
    assert out.node("parallax/replica_1/" + update).input[2] == "parallax/allreduce/w/replica_1"
    assert report == {"allreduce": 1, "ps": 0, "allgather": 0, "bfb": 0, "alltoall": 0,
                      "factors": 0}
