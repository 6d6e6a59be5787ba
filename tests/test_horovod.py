"""The Horovod backend: jobs under horovodrun (Gloo, loopback) equal one
device. The tests marked horovod run in the Horovod environment that
.ci/run builds (`pytest -m horovod`); the others in the main environment,
which has no Horovod."""
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

import parallax_ng as pn
from models import embedding_regression, local, train_single
from parallax_ng.errors import ConfigError
from task_env import TASK_PATH
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "horovod_script.py")


def horovodrun():
    found = shutil.which("horovodrun", path=os.path.dirname(sys.executable)) or \
        shutil.which("horovodrun")
    assert found, "horovodrun is not installed in this environment"
    return found


@pytest.mark.horovod
@pytest.mark.parametrize("devices,buckets,sparse", [
    (1, "none", "auto"), (2, "threshold", "auto"), (2, "single", "auto"),
    (2, "mgwfbp", "auto"), (1, "none", "alltoall"), (1, "none", "prefetch"),
    (1, "none", "horizontal"), (2, "none", "factors")])
def test_horovod_workers_match_one_device(tmp_path, devices, buckets, sparse):
    """Adam, global-norm clipping over dense and sparse gradients, EMA; dense
    gradients by HorovodAllreduce (per variable, or merged in buckets), the
    embedding's by HorovodAllgather, or cut by columns over the ranks with
    HorovodAlltoall (sparse_method alltoall, and with prefetch); or the
    dense updates a step later by block (horizontal, no clipping); or the
    kernels by their factors (dense_method factors: every replica's rows
    by HorovodAllgather, rows the graph does not know)."""
    out = str(tmp_path / "vars")
    cmd = [horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", "--network-interface",
           "lo", sys.executable, SCRIPT, out, "10", "--devices", str(devices),
           "--buckets", buckets] + (["--horizontal"] if sparse == "horizontal" else
                                    ["--dense", "factors"] if sparse == "factors" else
                                    ["--sparse", sparse])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    if sparse == "factors":
        assert "rank 1: factors ['dense/w', 'out/v']" in done.stdout, done.stdout[-2000:]
    single = train_single(*embedding_regression(4 * 2 * devices, "adam",
                                                clip=sparse != "horizontal", ema=True), 10)
    copies = 0
    for rank in range(2):
        with np.load(f"{out}.{rank}.npz") as d:
            for key in d.files:
                copies += 1
                got, want = d[key], single[key.split("#")[0]]
                assert np.max(np.abs(got - want)) <= 1e-5, key
    assert copies == 2 * devices * len(single)


@pytest.mark.horovod
def test_horovod_synchronized_batch_norm_matches_one_device(tmp_path):
    """`batch_norm: synchronized` under Horovod: 2 ranks of 2 devices, the
    features through the fused kernel (lowered), its statistics and their
    gradients the mean of the 4 replicas' by HorovodAllreduce, its row
    count their sum: every variable equals one device with the global
    batch (1e-5)."""
    out = str(tmp_path / "vars")
    cmd = [horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", "--network-interface",
           "lo", sys.executable, SCRIPT, out, "6", "--devices", "2", "--bn", "fused"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    assert "normalizes each replica's rows" not in done.stdout + done.stderr
    single = train_single(*embedding_regression(16, "adam", clip=True, ema=True, bn="fused"), 6)
    for rank in range(2):
        with np.load(f"{out}.{rank}.npz") as d:
            for key in d.files:
                np.testing.assert_allclose(d[key], single[key.split("#")[0]], atol=1e-5,
                                           rtol=0, err_msg=key)


@pytest.mark.horovod
@pytest.mark.parametrize("sparse", ["auto", "alltoall"])
def test_horovod_compressed_gradients_match_tensorflow_collectives(tmp_path, sparse):
    """communication.compression fp16 under Horovod (HorovodAlltoall and
    HorovodAllgather of 16-bit chunks, float32 sums; the embedding's rows
    all-gathered in 16 bits, or its gradient's columns exchanged in 16
    bits): 2 ranks end where TensorFlow's collectives put 2 replicas in one
    process with the same compression, 1e-5."""
    from models import read_name, variable_names
    out = str(tmp_path / "vars")
    cmd = [horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", "--network-interface",
           "lo", sys.executable, SCRIPT, out, "10", "--compression", "fp16", "--sparse", sparse]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    g, h = embedding_regression(4, "adam", clip=True, ema=True)
    with pn.get_runner(g, local(2), {"run_option": "allreduce", "sparse_method": sparse,
                                     "communication": {"compression": "fp16"}}) as runner:
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(10):
            runner.run(h["train"])
        names = variable_names(g)
        want = dict(zip(names, runner.run([read_name(v, g) for v in names])))
    for rank in range(2):
        with np.load(f"{out}.{rank}.npz") as d:
            for key in d.files:
                assert np.max(np.abs(d[key] - want[key.split("#")[0]])) <= 1e-5, key


@pytest.mark.horovod
@pytest.mark.parametrize("how", ["loop", "fit"])
def test_horovod_tf2_ranks_match_one_device(tmp_path, how):
    """A Keras 3 program under horovodrun (2 ranks x 1 device, backend
    horovod): a custom loop (`pn.function`) or `model.fit` then `evaluate`
    and `predict` (`pn.parallelize`), every rank called with the global
    batch; both equal one device with it, every weight and optimizer
    variable, 1e-5 (tests/test_tf2.py check_job)."""
    from test_tf2 import check_job
    out = str(tmp_path / "vars")
    cmd = [horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", "--network-interface",
           "lo", sys.executable, os.path.join(ROOT, "tests", "tf2_job_script.py"), out, "5",
           "--horovod"] + (["--fit"] if how == "fit" else [])
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    check_job(out, how)


def test_without_horovod_the_backend_is_a_clear_error():
    g, _ = embedding_regression(4)
    with pytest.raises(ConfigError, match=r"backend' is horovod.*pip install \.\[horovod\]"):
        pn.get_runner(g, local(1), {"run_option": "allreduce",
                                    "communication": {"backend": "horovod"}})
