"""The traffic model of a plan: Parallax's Table 3 per variable as flows
between tasks, the bytes each link carries, the busiest one
(parallax_ng/planning/traffic.py). Plans are made by the planner for made-up jobs;
no session runs."""
import pytest
import tensorflow as tf

import parallax_ng as pn
from parallax_ng.planning import traffic
from parallax_ng.planning.costmodel import Network
from parallax_ng.planning.traffic import Layout

tf1 = tf.compat.v1
ROWS, WIDTH, HIDDEN, CLASSES, BATCH = 1000, 16, 64, 500, 32
LOOKED_UP = BATCH * 8          # ids per replica and step: the analysis's estimate of rows
DENSE = (WIDTH * HIDDEN + HIDDEN + HIDDEN * CLASSES + CLASSES) * 4


def classifier():
    """A [ROWS, WIDTH] embedding read by 8 ids per example (sparse, its
    rows estimated as LOOKED_UP), and two dense layers holding DENSE bytes."""
    g = tf.Graph()
    with g.as_default():
        ids = tf1.placeholder(tf.int32, [BATCH, 8], name="ids")
        label = tf1.placeholder(tf.int64, [BATCH], name="label")
        emb = tf1.get_variable("emb", [ROWS, WIDTH])
        h = tf.reduce_mean(tf.nn.embedding_lookup(emb, ids), axis=1)
        h = tf.nn.relu(tf.matmul(h, tf1.get_variable("hidden/w", [WIDTH, HIDDEN])) +
                       tf1.get_variable("hidden/b", [HIDDEN]))
        logits = tf.matmul(h, tf1.get_variable("out/w", [HIDDEN, CLASSES])) + \
            tf1.get_variable("out/b", [CLASSES])
        loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=label, logits=logits))
        tf1.train.AdagradOptimizer(0.1).minimize(loss)
    return g


def plan_of(workers=2, servers="one", devices=1, **config):
    hosts = [{"address": f"10.0.0.{10 + i}:{4000 + i}",
              "devices": [f"cpu:{k}" for k in range(devices)]} for i in range(workers)]
    ps = "per_host" if servers == "per_host" else [f"10.0.0.{10 + workers}:5000"]
    resources = {"hosts": hosts, "ps": ps}
    plan = pn.transform_plan(classifier(), resources, {"run_option": "hybrid", **config})
    return plan, Layout(tuple(h["address"] for h in hosts), tuple(
        f"10.0.0.{10 + i}:{4001 + i}" for i in range(workers)) if servers == "per_host"
        else (f"10.0.0.{10 + workers}:5000",))


def test_ends_are_hosts_and_a_job_on_one_machine_moves_its_bytes_inside():
    layout = Layout(("10.0.0.1:2000", "10.0.0.2:2000"), ("10.0.0.1:2001", "10.0.0.3"))
    assert [layout.end(t) for t in layout.tasks()] == ["10.0.0.1", "10.0.0.2", "10.0.0.1",
                                                       "10.0.0.3"]
    assert layout.describe("10.0.0.1") == "10.0.0.1 (worker 0, ps 0)"
    local = Layout.local(2, 1)
    assert {local.end(t) for t in local.tasks()} == {"127.0.0.1"}
    flows = [("worker 0", "ps 0", 5.0, "a"), ("ps 0", "worker 1", 7.0, "a")]
    load = traffic.links(flows, layout)     # worker 0 -> ps 0 stays inside 10.0.0.1
    assert load.sent == {"10.0.0.1": 7.0} and load.received == {"10.0.0.2": 7.0}
    assert load.local == {"10.0.0.1": 5.0}
    assert traffic.links(flows, local) == traffic.Links({}, {}, {"127.0.0.1": 12.0})
    # free without a loopback rate; else the host's bytes inside at that rate
    assert load.busiest(1.0) == ("10.0.0.1", 7.0, 7.0, False)
    assert load.busiest(1.0, loopback=0.5) == ("10.0.0.1", 5.0, 10.0, True)
    assert load.busiest(1.0, loopback=1.0) == ("10.0.0.1", 7.0, 7.0, False)
    assert traffic.links(flows, local).busiest(1.0) == ("", 0.0, 0.0, False)


@pytest.mark.parametrize("workers", [2, 4])
def test_a_ring_sends_2_n_minus_1_over_n_of_the_dense_bytes_per_worker(workers):
    plan, layout = plan_of(workers, dense_method="allreduce")
    sent = traffic.task_bytes([f for f in traffic.flows(plan) if f[1].startswith("worker")])
    for i in range(workers):
        assert sent[f"worker {i}"] == pytest.approx(2 * (workers - 1) / workers * DENSE)


@pytest.mark.parametrize("workers", [2, 4])
def test_one_server_hears_every_worker_with_fusion_buffers(workers):
    plan, layout = plan_of(workers, dense_method="bfb")
    load = traffic.links(traffic.flows(plan), layout)
    server = f"10.0.0.{10 + workers}"
    sparse_in = LOOKED_UP * (WIDTH * 4 + 8 + 8)       # rows, their indices, the ids
    sparse_out = LOOKED_UP * WIDTH * 4
    assert load.received[server] == pytest.approx(workers * (DENSE + sparse_in))
    assert load.sent[server] == pytest.approx(workers * (DENSE + sparse_out))
    assert load.busiest()[0] == server
    for i in range(workers):
        assert load.sent[f"10.0.0.{10 + i}"] == pytest.approx(DENSE + sparse_in)


def test_a_server_per_host_gives_fusion_buffers_the_ring_s_bytes():
    """Herring's deployment: each worker's host also holds a server, so its
    own shard never crosses the NIC; a host sends 2(N-1)/N of the dense
    bytes, as a ring does."""
    workers = 4
    plan, layout = plan_of(workers, "per_host", dense_method="bfb")
    load = traffic.links(traffic.flows(plan), layout)
    ring_plan, _ = plan_of(workers, "per_host", dense_method="allreduce")
    ring = traffic.links(traffic.flows(ring_plan), layout)
    for i in range(workers):
        host = f"10.0.0.{10 + i}"
        dense = [b for s, d, b, what in traffic.flows(plan) if s == f"worker {i}" and
                 what.startswith("buffer") and layout.end(d) != host]
        assert sum(dense) == pytest.approx((workers - 1) / workers * DENSE, rel=1e-3)
        fused = traffic.links([f for f in traffic.flows(plan) if f[3] != "emb"], layout)
        assert fused.sent[host] == pytest.approx(2 * (workers - 1) / workers * DENSE)
        rung = traffic.links([f for f in traffic.flows(ring_plan) if f[3] != "emb"], layout)
        assert rung.sent[host] == pytest.approx(fused.sent[host])
        assert ring.sent[host] - rung.sent[host] == pytest.approx(
            load.sent[host] - fused.sent[host])          # the same sparse rows


def test_sparse_rows_on_a_server_and_by_all_gather():
    plan, layout = plan_of(2, dense_method="bfb", sparse_method="ps")
    rows = {"emb": 100.0}
    row, idx = WIDTH * 4, 4
    flows = traffic.flows(plan, {"emb": idx}, rows)
    to_server = sum(b for s, d, b, _ in flows if (s, d) == ("worker 0", "ps 0"))
    back = sum(b for s, d, b, _ in flows if (s, d) == ("ps 0", "worker 0"))
    assert to_server == pytest.approx(100 * (row + 2 * idx) + DENSE)
    assert back == pytest.approx(100 * row + DENSE)
    gathered, _ = plan_of(4, run_option="allreduce")
    flows = traffic.flows(gathered, {"emb": idx}, {"emb": 100.0})
    ring = [b for s, d, b, _ in flows if (s, d) == ("worker 0", "worker 1")]
    assert sum(ring) == pytest.approx(3 * 100 * (row + idx) +
                                      2 * 3 / 4 * (DENSE))


def test_compressed_gradients_count_half_their_bytes_and_ids_stay():
    """communication.compression: gradient values 2 bytes an element; ids,
    variables read back and rows looked up as they were."""
    row, idx, c = WIDTH * 4, 4, {"communication": {"compression": "bf16"}}
    plan, _ = plan_of(2, dense_method="bfb", sparse_method="ps", **c)
    flows = traffic.flows(plan, {"emb": idx}, {"emb": 100.0})
    to_server = sum(b for s, d, b, _ in flows if (s, d) == ("worker 0", "ps 0"))
    back = sum(b for s, d, b, _ in flows if (s, d) == ("ps 0", "worker 0"))
    assert to_server == pytest.approx(100 * (row / 2 + 2 * idx) + DENSE / 2)
    assert back == pytest.approx(100 * row + DENSE / 2)
    gathered, _ = plan_of(4, run_option="allreduce", **c)
    flows = traffic.flows(gathered, {"emb": idx}, {"emb": 100.0})
    ring = [b for s, d, b, _ in flows if (s, d) == ("worker 0", "worker 1")]
    assert sum(ring) == pytest.approx(3 * 100 * (row / 2 + idx) + 3 / 4 * DENSE)


def test_predict_takes_the_busiest_link_and_the_rounds_of_messages():
    """bytes / B on the busiest link, plus a per round of collectives and r
    per round trip to the servers (when a step runs its collectives beside
    its server work: the second session run's s and one more r)."""
    net = Network(1e6, 1e-4, collective=2e-3, round_trip=3e-3, session_run=5e-3)
    fused, layout = plan_of(2, dense_method="bfb")            # sparse on the server
    p = traffic.predict(fused, layout, net)
    assert p.end == "10.0.0.12" and traffic.rounds(fused) == (0, 2)
    assert p.seconds == pytest.approx(p.nbytes / 1e6 + 2 * 3e-3)
    split, _ = plan_of(2, dense_method="allreduce", sparse_method="ps")
    assert traffic.rounds(split) == (1, 2)
    assert traffic.predict(split, layout, net).fixed_seconds == pytest.approx(
        2e-3 + 3 * 3e-3 + 5e-3)
    ring, _ = plan_of(2, dense_method="allreduce", sparse_method="allgather")
    assert traffic.rounds(ring) == (2, 0)
    assert traffic.predict(ring, layout, net).fixed_seconds == pytest.approx(2 * 2e-3)
    assert traffic.predict(ring, layout, net).seconds < p.seconds      # half the bytes
    unmeasured = Network(1e6, 1e-4)
    assert traffic.predict(ring, layout, unmeasured).fixed_seconds == pytest.approx(
        2 * 2 * (2 - 1) * 1e-4)


def test_on_one_host_a_round_trip_to_s_servers_costs_s_times_the_measured_one():
    """The round trip r is measured with one server; on one host the
    servers' messages share its cores, so a plan that gives 4 servers work
    pays 4 r per round trip there, and r where they have hosts of their
    own. A plan that gives the servers nothing pays no round trip."""
    net = Network(1e6, 1e-4, collective=2e-3, round_trip=3e-3, session_run=5e-3,
                  loopback=1e7)
    fused, apart = plan_of(4, "per_host", dense_method="bfb")
    one = Layout.local(4, 4)
    assert {d for _, d, _, _ in traffic.flows(fused)} >= {f"ps {j}" for j in range(4)}
    assert traffic.predict(fused, apart, net).fixed_seconds == pytest.approx(2 * 3e-3)
    assert traffic.predict(fused, one, net).fixed_seconds == pytest.approx(2 * 4 * 3e-3)
    ring, _ = plan_of(4, "per_host", dense_method="allreduce", sparse_method="allgather")
    assert traffic.predict(ring, one, net).fixed_seconds == pytest.approx(
        traffic.predict(ring, apart, net).fixed_seconds)
    single, layout = plan_of(4, dense_method="bfb")
    assert traffic.predict(single, Layout.local(4, 1), net).fixed_seconds == pytest.approx(
        traffic.predict(single, layout, net).fixed_seconds)


def test_row_ranges_carry_the_share_of_the_rows_a_step_touched():
    """A server per host: the embedding cut into two row ranges. Each range
    answers its share of the lookups; the gradient's rows all go to the
    first range's server, which sends the second range its share of both
    workers' rows. Without a measured sample each range's share is half;
    with one (every touched row in the first range) the first has all."""
    from dataclasses import replace

    from parallax_ng.planning.placement import Sharded
    plan, _ = plan_of(2, "per_host", dense_method="bfb", sparse_method="ps")
    assert isinstance(plan.placement["emb"], Sharded)
    rows, row, idx = {"emb": 100.0}, WIDTH * 4, 4

    def to_servers(p):
        flows = traffic.flows(p, {"emb": idx}, rows)
        return [sum(b for s, d, b, what in flows if (s, d, what) == (src, dst, "emb"))
                for src, dst in [("worker 0", "ps 0"), ("worker 0", "ps 1"), ("ps 0", "ps 1")]]
    assert to_servers(plan) == pytest.approx(
        [50 * idx + 100 * (row + idx), 50 * idx, 0.5 * 2 * 100 * (row + idx)])
    vp = plan.variables["emb"]
    head = replace(plan, variables={**plan.variables, "emb": replace(
        vp, info=replace(vp.info, touched=tuple(range(100))))})
    assert to_servers(head) == pytest.approx([100 * idx + 100 * (row + idx), 0.0, 0.0])
