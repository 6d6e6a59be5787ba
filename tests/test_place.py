from passkit import HOST, context, devices, run_passes
from transforms.aggregate import AggregatePass
from transforms.place import PlacePass, host_cpu_of
from transforms.replicate import ReplicatePass


def placed(n=2, kind="CPU", **cfg):
    ctx = context(n=n, kind=kind, **cfg)
    return ctx, run_passes(ctx, ReplicatePass(), AggregatePass(), PlacePass())


def test_replicas_on_their_devices_shared_state_on_the_server():
    ctx, ir = placed(n=2, optimizer="adam", run_option="hybrid")
    dev = devices(2)
    assert ir.node("dense/w").device == dev[0]
    assert ir.node("parallax/replica_1/dense/w").device == dev[1]
    assert ir.node("parallax/replica_1/MatMul").device == dev[1]
    # the shared embedding, its slots, its update and every replica's lookup of it
    for name in ("emb", "emb/Adam", "Adam/update_emb/ResourceScatterAdd",
                 "parallax/replica_1/embedding_lookup"):
        assert ir.node(name).device == HOST, name
    # update math that only feeds the shared writers moves with them
    assert ir.node("Adam/update_emb/Unique").device == HOST
    # per-replica gradient computation stays on the replica
    grad = ctx.tg.gradients["emb"].values.node
    assert ir.node("parallax/replica_1/" + grad).device == dev[1]


def test_gpu_replicas_keep_input_pipeline_and_cpu_pins_on_the_host_cpu():
    ctx, ir = placed(n=2, kind="GPU", run_option="allreduce")
    gpu = devices(2, "GPU")
    assert ir.node("parallax/replica_1/MatMul").device == gpu[1]
    assert ir.node("parallax/replica_1/IteratorGetNext").device == host_cpu_of(gpu[1])
    assert ir.node("parallax/replica_1/TensorSliceDataset").device.endswith("CPU:0")
    assert ir.node("parallax/replica_1/dense/w").device == gpu[1]
    # the dense variables' bucket: packed, reduced and split on each GPU
    bucket = [n for n in ir.nodes if n.name.startswith("parallax/bucket_0/")]
    assert {n.op for n in bucket} >= {"ConcatV2", "CollectiveReduce", "SplitV"}
    for n in bucket:
        if n.op != "Const":
            assert n.device == gpu[int(n.name.split("/replica_")[1].split("/")[0])], n.name


def test_host_cpu_of():
    assert host_cpu_of("/job:worker/replica:0/task:3/device:GPU:2") == \
        "/job:worker/replica:0/task:3/device:CPU:0"


def test_multi_worker_colocation_never_contradicts_a_device():
    """clip_by_global_norm colocates its math with each gradient; on a job
    with servers the server's update math must stay on the server."""
    from models import embedding_regression
    from passkit import cluster_transform
    g, _ = embedding_regression(4, "adagrad", clip=True)
    ir, _ = cluster_transform(g, worker=0)
    for nd in ir.nodes:
        for loc in (nd.attr["_class"].list.s if "_class" in nd.attr else ()):
            target = ir.get(loc.decode().removeprefix("loc:@"))
            assert target is None or target.device == nd.device, (nd.name, target.name)
    ps = "/job:ps/replica:0/task:0/device:CPU:0"
    assert ir.node("global_norm/L2Loss").device == ps   # the embedding's squared norm
    scaled = [n for n in ir.nodes if n.name.startswith("clip_by_global_norm/mul")
              and n.device == ps]
    assert scaled   # the embedding gradient is scaled where it is applied


def test_golden_tiny_graph():
    """Replica k's ops on device k; under ps, w (once) and its update on the host."""
    from passkit import tiny_graph
    update = "train/update_w/ResourceApplyGradientDescent"
    ctx = context(n=2, graph=tiny_graph(), run_option="allreduce")
    ir = run_passes(ctx, ReplicatePass(), AggregatePass(), PlacePass())
    assert ir.node("w").device == ir.node(update).device == devices(2)[0]
    assert ir.node("parallax/replica_1/w").device == devices(2)[1]
    assert ir.node("parallax/replica_1/MatMul").device == devices(2)[1]
    ctx = context(n=2, graph=tiny_graph(), run_option="ps")
    ir = run_passes(ctx, ReplicatePass(), AggregatePass(), PlacePass())
    assert ir.node("w").device == ir.node(update).device == HOST
    assert "parallax/replica_1/w" not in ir
    assert ir.node("parallax/replica_1/MatMul").device == devices(2)[1]
