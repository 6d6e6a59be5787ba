"""Balanced fusion buffers (method bfb, Herring III-1/III-2): the plan's
buffers, their balance over servers, and training equal to one device
in-process and as jobs."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from model_shapes import bert_base, parameters, resnet50, training_graph
from models import embedding_regression, local, train_both
from parallax_ng.errors import ConfigError
from parallax_ng.planning.buckets import fusion_buffer_size

tf1 = tf.compat.v1


def job(workers: int, servers: int) -> dict:
    return {"hosts": [{"address": "127.0.0.1", "devices": ["cpu:0"]}] * workers,
            "ps": ["127.0.0.1"] * servers}


def segments_by_variable(plan) -> dict:
    out = {}
    for b in plan.buffers:
        for s in b.segments:
            out.setdefault(s.var, []).append((s.start, s.size))
    return out


def test_buffers_pack_every_element_once_in_ready_order():
    g = training_graph([("a", (10,)), ("b", (7, 3)), ("c", (5,))])
    plan = pn.transform_plan(g, job(2, 2), {"dense_method": "bfb",
                                            "fusion": {"buffer_bytes": 48}})
    assert {v: vp.method for v, vp in plan.variables.items()} == dict.fromkeys("abc", "bfb")
    # backward order: the last variable read is the first gradient ready
    assert [s.var for s in plan.buffers[0].segments] == ["c", "b"]
    lengths = [b.placement.length for b in plan.buffers]
    assert lengths == [12, 12, 12] and sum(lengths) == 36   # 48 bytes = 12 floats
    for var, parts in segments_by_variable(plan).items():
        starts = [start for start, _ in parts]
        assert starts == sorted(starts) and sum(size for _, size in parts) == \
            {"a": 10, "b": 21, "c": 5}[var]
    for b in plan.buffers:
        offsets = [s.offset for s in b.segments]
        assert offsets[0] == 0 and all(
            s.offset + s.size == t.offset for s, t in zip(b.segments, b.segments[1:]))
        assert [s.size for s in b.placement.shards] == [6, 6]
        assert [s.device for s in b.placement.shards] == [
            "/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    assert plan.schedule.split and not plan.shared_state()
    assert "fusion buffers: 3" in plan.format()


def test_buffer_size_from_model_and_cluster():
    assert fusion_buffer_size(100 * 2**20, 4) == 25 * 2**20        # four buffers
    assert fusion_buffer_size(1_000_000, 4) == 1_000_000          # shards >= 256 KB: one buffer
    assert fusion_buffer_size(2 * 2**30, 2) == 64 * 2**20          # at most 64 MB
    with pytest.raises(ConfigError, match="fusion.buffer_bytes"):
        pn.Config.from_dict({"fusion": {"buffer_bytes": -1}})
    with pytest.raises(ConfigError, match="dense_method.*allowed: auto, allreduce, bfb, ps"):
        pn.Config.from_dict({"dense_method": "ring"})


def test_sparse_variables_are_refused_and_horovod_jobs_have_no_servers():
    g, _ = embedding_regression(4)
    with pytest.raises(ConfigError, match="variable_methods.emb.*bfb.*sparse"):
        pn.transform_plan(g, job(2, 1), {"variable_methods": {"emb": "bfb"}})
    with pytest.raises(ConfigError,
                       match=r"gradients of \[.dense/b., .dense/w.*none; list `ps:.*per_host"):
        pn.transform_plan(g, job(2, 0), {"dense_method": "bfb", "run_option": "allreduce"})
    with pytest.raises(ConfigError, match="backend horovod does not have"):
        pn.transform_plan(g, job(2, 1), {"dense_method": "bfb",
                                          "communication": {"backend": "horovod"}})


def load_ratio(load: dict) -> float:
    values = list(load.values())
    return max(values) / (sum(values) / len(values))


@pytest.mark.parametrize("model", ["resnet50", "bert_base"])
def test_balance_on_real_models(model):
    """Bytes per server per step, max/mean: balanced fusion buffers within
    1% for 2 to 16 servers; whole variables placed greedily or round-robin
    (ps) are not, since single variables outweigh a server's share."""
    shapes = {"resnet50": resnet50, "bert_base": bert_base}[model]()
    assert parameters(shapes) == {"resnet50": 25_583_592, "bert_base": 109_482_240}[model]
    g = training_graph(shapes)
    ratios = {}
    for servers in (2, 4, 8, 16):
        res = job(2, servers)
        bfb = pn.transform_plan(g, res, {"dense_method": "bfb"})
        greedy = pn.transform_plan(g, res, {"run_option": "ps"})
        robin = pn.transform_plan(g, res, {"run_option": "ps", "ps_placement": "round_robin"})
        ratios[servers] = (load_ratio(bfb.buffer_load()), load_ratio(greedy.server_load()),
                           load_ratio(robin.server_load()))
        assert sum(bfb.buffer_load().values()) == pytest.approx(4 * parameters(shapes))
    print(model, ratios)
    for servers, (balanced, greedy, robin) in ratios.items():
        assert balanced <= 1.01, (servers, balanced)
        assert robin > 1.01, (servers, robin)
    assert max(greedy for _, greedy, _ in ratios.values()) > 1.01


@pytest.mark.parametrize("buffer", [0, 64, 1000])
@pytest.mark.parametrize("optimizer", ["adam", "sgd"])
def test_in_process_equals_one_device(optimizer, buffer):
    """2 replicas, dense variables by fusion buffers (64 bytes: every
    variable cut over several buffers), sparse by the host; Adam or SGD,
    clipping, moving averages: every variable and slot within 1e-5."""
    def build(batch):
        return embedding_regression(batch, optimizer, clip=True, ema=True)
    config = {"dense_method": "bfb", "fusion": {"buffer_bytes": buffer}}
    parallel, single, names = train_both(build, 2, 10, local(2), config)
    for name in names:
        for got in parallel[name]:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name


def test_the_graph_sums_each_shard_on_its_server():
    g, h = embedding_regression(4)
    ir, ctx, _ = pn.transform(g, None, {"dense_method": "bfb", "fusion": {"buffer_bytes": 64}},
                              cluster_info=None, plan=pn.transform_plan(
                                  g, job(2, 2), {"dense_method": "bfb",
                                                 "fusion": {"buffer_bytes": 64}}))
    plan = ctx.plan
    assert plan.worker == 0 and len(plan.buffers) > 2
    for b, buf in enumerate(plan.buffers):
        for i, shard in enumerate(buf.placement.shards):
            total = ir.node(f"parallax/bfb/buffer_{b}/shard_{i}/total")
            assert total.op == "AddN" and total.device == shard.device
            take = ir.node(f"parallax/bfb/buffer_{b}/shard_{i}/from_1/take")
            assert take.op == "QueueDequeueV2"
    step = ir.ancestors([h["train"].name])
    assert not [n for n in step if ir.node(n).op.startswith("Collective")]


@pytest.mark.parametrize("workers,devices,servers,buffer", [
    (2, 1, 1, 0), (2, 1, 2, 64), (2, 2, 2, 0), (2, 2, 3, 200), (2, 1, "per_host", 0)])
def test_jobs_equal_one_device(tmp_path, workers, devices, servers, buffer):
    """Hybrid with dense variables by fusion buffers (sizes that cut
    variables) and the embedding on a server; Adam, global-norm clipping,
    moving averages: every variable and slot of every replica within 1e-5
    of one device after 10 steps, and no step mixes collectives with the
    servers: one session.run per step, the barrier inside it."""
    from test_cluster import assert_matches_one_device, run_job
    done, out, _ = run_job(tmp_path, workers, devices, "10", "--run-option", "hybrid",
                           "--dense-method", "bfb", "--buffer-bytes", str(buffer),
                           servers=servers)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "worker 0: 1 session run(s) per step" in done.stdout, done.stdout[-2000:]
    assert "worker 1: 1 session run(s) per step" in done.stdout, done.stdout[-2000:]
    assert_matches_one_device(out, workers, devices)
