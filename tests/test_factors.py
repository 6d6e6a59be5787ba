"""Dense gradients by their factors (method `factors`): a weight whose
gradient is MatMul(a, b, transpose_a=True) gets every replica's a and b
gathered and the product taken on each replica, which equals the summed
gradient. N replicas with batch b equal one device with batch N*b after 10
steps (every variable and slot, 1e-5); the analysis finds the factors only
where the gradient is such a product of sizes the graph knows."""
import itertools

import numpy as np
import pytest

import parallax_ng as pn
from models import embedding_regression, local, train_both
from parallax_ng.errors import ConfigError
from parallax_ng.graph.frontend import load
from parallax_ng.methods import factor_bytes
from parallax_ng.planning.analysis import analyze, unknown_rows
from parallax_ng.planning.profile import first_step_profile

STEPS, BATCH, TOL = 10, 4, 1e-5


def test_the_analysis_finds_the_factors_of_a_dense_layers_weights():
    g, h = embedding_regression(BATCH, static_batch=True)
    info = analyze(load(g))
    # dense/w is [DIM + FEATURES, 8] = [9, 8], read by a [4, 9] batch; out/v [8, 1]
    assert info["dense/w"].factors == (BATCH, 9 + 8)
    assert info["out/v"].factors == (BATCH, 8 + 1)
    assert info["dense/b"].factors is None          # a sum over rows, not a product
    assert info["emb"].factors is None              # sparse
    assert factor_bytes(info["dense/w"]) == BATCH * 17 * 4


def test_a_measured_step_gives_the_rows_the_graph_does_not_know():
    g, h = embedding_regression(BATCH)
    tg = load(g)
    info = analyze(tg)
    assert info["dense/w"].factors == (None, 17) and factor_bytes(info["dense/w"]) == 0
    assert set(unknown_rows(tg, info)) == {"dense/w", "out/v"}
    profile, why = first_step_profile(tg, 30.0)
    assert not why and profile.factor_rows == {"dense/w": BATCH, "out/v": BATCH}
    assert profile.apply(info, tg)["dense/w"].factors == (BATCH, 17)


def test_unknown_rows_are_measured_in_the_first_steps_in_process():
    seen = {}
    train_both(lambda b: embedding_regression(b, "sgd"), 2, 3,
               config={"run_option": "allreduce", "dense_method": "factors"}, seen=seen)
    plan = seen["plan"]
    assert plan.variables["dense/w"].method == "factors"
    assert plan.variables["dense/w"].info.factors == (BATCH, 17)
    # Table 3's bytes of a replica: its factors out and every other's in
    assert plan.bytes_per_replica()["dense/w"] == 2 * BATCH * 17 * 4


CASES = list(itertools.product(["allreduce", "hybrid"], ["sgd", "adam", "momentum"],
                               ["plain", "clip+ema"]))


@pytest.mark.parametrize("run_option,optimizer,variant", CASES,
                         ids=["-".join(c) for c in CASES])
def test_two_replicas_by_factors_equal_one_device(run_option, optimizer, variant):
    extras = {"clip": True, "ema": True} if variant == "clip+ema" else {}
    seen = {}
    parallel, single, names = train_both(
        lambda b: embedding_regression(b, optimizer, static_batch=True, **extras), 2, STEPS,
        config={"run_option": run_option, "dense_method": "factors"}, seen=seen)
    methods = {v: vp.method for v, vp in seen["plan"].variables.items()}
    assert methods["dense/w"] == methods["out/v"] == "factors"
    assert methods["dense/b"] == "allreduce"        # no factors: the run option's method
    assert "dense/b: dense_method factors not used (its gradient is not MatMul" in \
        " ".join(seen["plan"].unmet())
    assert len(single) >= 5
    for name, want in single.items():
        for k, got in enumerate(parallel[name]):
            diff = np.max(np.abs(np.asarray(got) - want))
            assert diff <= TOL, f"{name} on replica {k}: max abs diff {diff}"


def test_a_variable_without_factors_named_for_them_is_an_error():
    g, h = embedding_regression(BATCH, static_batch=True)
    with pytest.raises(ConfigError, match=r"variable_methods.dense/b' is factors.*not "
                                          r"MatMul\(a, b, transpose_a=True\).*use allreduce, "
                                          r"bfb, ps"):
        pn.get_runner(g, local(2), {"variable_methods": {"dense/b": "factors"}})


@pytest.mark.parametrize("run_option,servers", [("allreduce", 0), ("hybrid", 1)])
def test_a_two_worker_job_by_factors_equals_one_device(tmp_path, run_option, servers):
    """Adam, global-norm clipping, EMA, 10 steps, 2 workers: the factors
    gathered across the workers (beside the embedding on a server in
    hybrid), every variable and slot within 1e-5 of one device."""
    from test_cluster import assert_matches_one_device, run_job
    done, out, _ = run_job(tmp_path, 2, 1, "10", "--run-option", run_option,
                           "--dense-method", "factors", "--static-batch", servers=servers)
    assert done.returncode == 0, done.stderr[-3000:]
    for w in range(2):
        assert f"worker {w}: factors ['dense/w', 'out/v']" in done.stdout
    assert_matches_one_device(out, 2, 1)


def test_keras3_fit_by_factors_equals_one_device():
    """A Keras 3 classifier (embedding, two Dense layers; Adam with
    global_clipnorm): the kernels by their factors, whose rows the first
    step measures (the captured step's batch has no size); 2 epochs of
    fit equal one device, every weight and optimizer variable."""
    import keras

    from test_tf2 import check_equal

    def make():
        inp = keras.Input((3,), dtype="int32")
        h = keras.layers.GlobalAveragePooling1D()(keras.layers.Embedding(50, 8)(inp))
        h = keras.layers.Dense(16, activation="relu")(h)
        return keras.Model(inp, keras.layers.Dense(12)(h))
    parallel, single = make(), make()
    single.set_weights(parallel.get_weights())
    for m in (parallel, single):
        m.compile(keras.optimizers.Adam(0.01, global_clipnorm=1.0),
                  keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    pn.parallelize(parallel, local(2), {"run_option": "allreduce", "dense_method": "factors"})
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 50, (64, 3)), rng.integers(0, 12, (64,))
    for m in (parallel, single):
        m.fit(x, y, batch_size=16, epochs=2, shuffle=False, verbose=0)
    check_equal((parallel, parallel.optimizer), (single, single.optimizer))
    plan = parallel._parallax_ng.step.runner.plan
    kernels = {v: vp.info.factors for v, vp in plan.variables.items() if vp.method == "factors"}
    assert sorted(kernels.values()) == [(8, 8 + 16), (8, 16 + 12)], kernels
