import pytest
import tensorflow as tf

from models import embedding_regression
from parallax_ng.graph import frontend
from parallax_ng.planning.analysis import analyze, with_measured_alpha
from parallax_ng.config import Config
from parallax_ng.errors import ConfigError
from parallax_ng.planning.planner import make_plan

DEVICES = [f"/job:localhost/replica:0/task:0/device:CPU:{k}" for k in range(4)]
HOST = DEVICES[0]


@pytest.fixture(scope="module")
def tg():
    return frontend.load(embedding_regression(4, "adam", ema=True)[0])


def plan_for(tg, **cfg):
    return make_plan(tg, analyze(tg), Config(**cfg), DEVICES, HOST)


def test_analysis(tg):
    info = analyze(tg)
    assert info["emb"].sparse and not info["dense/w"].sparse
    assert info["emb"].nbytes == 40 * 4 * 4
    assert info["emb"].order < info["out/v"].order    # forward order
    measured = with_measured_alpha(info, {"emb": 0.25})
    assert measured["emb"].alpha == 0.25 and measured["emb"].alpha_source == "measured"


@pytest.mark.parametrize("run_option,emb,dense", [
    ("hybrid", "ps", "allreduce"), ("allreduce", "allgather", "allreduce"), ("ps", "ps", "ps")])
def test_methods_per_run_option(tg, run_option, emb, dense):
    plan = plan_for(tg, run_option=run_option)
    assert plan.variables["emb"].method == emb
    assert {plan.variables[v].method for v in ("dense/w", "dense/b", "out/v")} == {dense}
    shared = plan.shared_state()
    assert ("emb/Adam" in shared) == (emb == "ps")
    assert "global_step" not in shared
    assert plan.placement["emb/ExponentialMovingAverage"] == plan.placement["emb"]


def test_overrides_and_bad_overrides(tg):
    plan = plan_for(tg, variable_methods={"dense/w": "ps"})
    assert plan.variables["dense/w"].method == "ps"
    with pytest.raises(ConfigError, match="not trained variables"):
        plan_for(tg, variable_methods={"nope": "ps"})
    with pytest.raises(ConfigError, match="dense gradient"):
        plan_for(tg, variable_methods={"dense/w": "allgather"})


def test_plan_is_printable_data_with_traffic_model(tg):
    plan = plan_for(tg)
    text = plan.format()
    assert "emb" in text and "sparse" in text and "allreduce" in text
    d = plan.to_dict()
    assert d["variables"]["emb"]["method"] == "ps" and len(d["devices"]) == 4
    traffic = plan.bytes_per_replica()
    b = plan.variables["dense/w"].info.nbytes
    assert traffic["dense/w"] == pytest.approx(2 * 3 * b / 4)   # ring all-reduce


def test_shared_variables_spread_over_servers_by_bytes():
    g = tf.Graph()
    with g.as_default():
        x = tf.compat.v1.placeholder(tf.float32, [None, 10], name="x")
        sizes = {"big": [10, 100], "mid": [10, 60], "small": [10, 50]}
        ws = {k: tf.compat.v1.get_variable(k, s) for k, s in sizes.items()}
        loss = tf.add_n([tf.reduce_sum(tf.matmul(x, w)) for w in ws.values()])
        tf.compat.v1.train.AdamOptimizer(0.1).minimize(loss)
    tg = frontend.load(g)
    servers = ["/job:ps/replica:0/task:0/device:CPU:0", "/job:ps/replica:0/task:1/device:CPU:0"]
    plan = make_plan(tg, analyze(tg), Config(run_option="ps"), ["/job:worker/task:0/cpu:0"],
                     "/job:worker/task:0/cpu:0", num_workers=2, worker=0, servers=servers)
    assert plan.server("big") == servers[0]
    assert plan.server("mid") == plan.server("small") == servers[1]
    for var in sizes:   # slots live with their variable
        assert plan.server(f"{var}/Adam") == plan.server(f"{var}/Adam_1") == plan.server(var)
    assert "servers:" in plan.format()
    assert plan.to_dict()["placement"]["big"] == {"kind": "shared", "device": servers[0]}
    with pytest.raises(ConfigError, match="list `ps: \\[address\\]`"):
        make_plan(tg, analyze(tg), Config(run_option="ps"), ["/job:worker/task:0/cpu:0"],
                  "/job:worker/task:0/cpu:0", num_workers=2, worker=0)


def test_horovod_backend_has_no_parameter_servers(tg):
    with pytest.raises(ConfigError, match="backend horovod does not have"):
        make_plan(tg, analyze(tg), Config.from_dict(
                      {"run_option": "ps", "communication": {"backend": "horovod"}}),
                  DEVICES, HOST, num_workers=2, worker=0)
    hybrid = make_plan(tg, analyze(tg), Config.from_dict(
        {"run_option": "hybrid", "communication": {"backend": "horovod"}}),
        DEVICES, HOST, num_workers=2, worker=0)
    assert hybrid.variables["emb"].method == "allgather"
    assert hybrid.unmet() == [
        "run_option hybrid: the job has no parameter server (`ps:` in the resource file), "
        "so sparse gradients go by all-gather, as under run_option allreduce"]
    plan = make_plan(tg, analyze(tg), Config.from_dict(
                         {"run_option": "allreduce", "communication": {"backend": "horovod"}}),
                     DEVICES, HOST, num_workers=2, worker=1)
    assert plan.backend == "horovod" and plan.to_dict()["backend"] == "horovod"


def test_what_the_config_asks_and_the_plan_does_not_do_is_said_once(capsys):
    """At get_runner, one line per setting a variable does not get, with
    the reason: prefetch (alltoall only), horizontal scheduling (not with a
    global norm over the dense gradients), sparse_method allreduce (rows
    used one by one)."""
    import parallax_ng as pn
    from models import local
    g, _ = embedding_regression(4, "adam", clip=True)
    with pn.get_runner(g, local(2), {"run_option": "allreduce", "prefetch": True,
                                     "horizontal_scheduling": True}) as runner:
        lines = runner.plan.unmet()
    err = capsys.readouterr().err
    assert "emb: no prefetch: it applies to alltoall, not allgather" in lines
    assert any(line.startswith("dense/w: no horizontal scheduling: ") for line in lines)
    assert [f"parallax_ng: {line}" for line in lines] == [
        line for line in err.splitlines() if line.startswith("parallax_ng: ")]


def test_a_one_worker_job_puts_shared_variables_on_its_server():
    import parallax_ng as pn
    g, _ = embedding_regression(4, "adam")
    res = {"hosts": [{"devices": ["cpu:0", "cpu:1"]}], "ps": ["127.0.0.1"]}
    plan = pn.transform_plan(g, res, {"run_option": "hybrid"})
    assert plan.num_workers == 1 and plan.server("emb").startswith("/job:ps/")
    assert plan.server("emb/Adam").startswith("/job:ps/") and not plan.cross_worker_servers
