"""Checkpoints: a job killed after step k and started again ends with exactly
the variables of an uninterrupted run (in-process and multi-worker)."""
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

import forked
import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng.config import load_config
from parallax_ng.errors import ConfigError
from task_env import TASK_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "resume_script.py")
ENV = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2")


def run(cmd, expect_ok=True):
    """A script forked (tests/forked.py); a job started as a process."""
    done = (forked.run(cmd, env=ENV, timeout=300) if cmd[1] != "-m" else
            subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV))
    if expect_ok:
        assert done.returncode == 0, done.stderr[-3000:]
    return done


def load(prefix, workers=1):
    out = {}
    for t in range(workers):
        with np.load(f"{prefix}.{t}.npz") as d:
            out.update({f"{t}/{k}": d[k] for k in d.files})
    return out


ALLTOALL = '{"run_option": "allreduce", "sparse_method": "alltoall"}'
PREFETCH = '{"run_option": "allreduce", "sparse_method": "alltoall", "prefetch": true}'
LATER = '{"run_option": "allreduce", "horizontal_scheduling": true}'


def test_a_run_that_ends_saves_its_last_steps_and_says_so(tmp_path):
    """7 steps with every_steps 5: saved at 5 and, as the run ends, at 7;
    a rerun restores step 7 and says where from."""
    ck, out = str(tmp_path / "ck"), str(tmp_path / "out")
    first = run([sys.executable, SCRIPT, ck, out, "7"])
    assert [ln for ln in first.stderr.splitlines() if "parallax_ng: " in ln] == [
        f"parallax_ng: saved step {s} to {ck}/model.ckpt-{s}" for s in (5, 7)]
    assert "update_checkpoint_state" not in first.stderr     # (its deprecation notice)
    again = run([sys.executable, SCRIPT, ck, out, "9"])
    assert "starting at step 7" in again.stdout
    assert f"parallax_ng: restored step 7 from {ck}/model.ckpt-7" in again.stderr


@pytest.mark.parametrize("config", ["{}", ALLTOALL, PREFETCH, LATER],
                         ids=["hybrid", "alltoall", "prefetch", "horizontal"])
def test_killed_and_restarted_in_process_run_equals_uninterrupted(tmp_path, config):
    """Alltoall: each replica holds its columns of the table; the checkpoint
    holds the whole table, and each replica restores its columns. Prefetch
    and horizontal scheduling (no clipping: a global norm over dense
    gradients turns it off): a checkpoint holds every step's update, what a
    step left for the next applied first. Seeded dropout draws on where the
    checkpoint's streams were."""
    whole, broken = str(tmp_path / "whole"), str(tmp_path / "broken")
    more = ["--config", config, "--dropout", "0.3"] + (["--no-clip"] if config == LATER else [])
    run([sys.executable, SCRIPT, str(tmp_path / "ck_whole"), whole, "20"] + more)
    ck = str(tmp_path / "ck")
    died = run([sys.executable, SCRIPT, ck, broken, "20", "--die-at", "13"] + more,
               expect_ok=False)
    assert died.returncode == 9
    assert tf.train.latest_checkpoint(ck).endswith("model.ckpt-10")
    again = run([sys.executable, SCRIPT, ck, broken, "20"] + more)
    assert "starting at step 10" in again.stdout
    a, b = load(whole), load(broken)
    assert set(a) == set(b) and len(a) > 20
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


BFB, RING = '{"dense_method": "bfb"}', '{"dense_method": "allreduce"}'


@pytest.mark.parametrize("run_option,servers,extra", [   # (all-reduce alone: test_restarts.py)
    ("hybrid", 1, ["--config", BFB]),
    ("hybrid", 1, ["--config", RING]),       # collectives beside the server's run
    ("hybrid", 2, ["--no-ema", "--config", BFB]),   # the embedding by rows on two servers
    ("allreduce", 0, ["--config", ALLTOALL])])   # by columns over the workers
def test_killed_and_restarted_two_worker_job_equals_uninterrupted(tmp_path, run_option,
                                                                  servers, extra):
    """Both workers die after step 7 (checkpoints every 5 steps); the
    launcher (`--restarts 1`) starts the job again from step 5."""
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * 2
                   + (f"ps: [{', '.join(['127.0.0.1'] * servers)}]\n" if servers else ""))
    launch = [sys.executable, "-m", "parallax_ng", "run", "-r", str(res)]
    whole, broken = str(tmp_path / "whole"), str(tmp_path / "broken")
    option = ["--run-option", run_option] + extra
    run(launch + [SCRIPT, "--", str(tmp_path / "ck_whole"), whole, "15"] + option)
    ck = str(tmp_path / "ck")
    again = run(launch + ["--restarts", "1", SCRIPT, "--", ck, broken, "15", "--die-at", "7",
                          "--once"] + option)
    assert "restart 1 of 1" in again.stderr + again.stdout
    assert again.stdout.count("starting at step 5") == 2
    for w in (0, 1):
        assert f"[worker {w}] parallax_ng: restored step 5 from {ck}/model.ckpt-5" in \
            again.stderr
    # one copy of the variables; each worker's input positions beside it
    assert sorted(os.listdir(ck)) == ["checkpoint", "inputs"] + [
        f"model.ckpt-{s}.{x}" for s in (10, 15, 5) for x in ("data-00000-of-00001", "index")]
    assert again.stderr.count("parallax_ng: saved step 15") == 1
    for w in (0, 1):
        assert tf.train.latest_checkpoint(f"{ck}/inputs/worker-{w}").endswith("ckpt-15")
    a, b = load(whole, 2), load(broken, 2)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("sparse", ["auto", "alltoall"])
def test_checkpoint_is_a_single_device_checkpoint(tmp_path, sparse):
    """With alltoall the table's columns live on the replicas; the checkpoint
    holds it whole, with its slots."""
    g, h = embedding_regression(4, "adam")
    cfg = {"checkpoint": {"dir": str(tmp_path), "every_steps": 2}, "sparse_method": sparse}
    names = ["dense/w", "emb", "emb/Adam"]
    with pn.get_runner(g, local(2), cfg) as runner:
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(4):
            runner.run(h["train"])
        want = runner.run([f"{n}/Read/ReadVariableOp:0" for n in names[:2]])
    path = tf.train.latest_checkpoint(str(tmp_path))
    assert path.endswith("model.ckpt-4")
    with g.as_default():
        saver = tf.compat.v1.train.Saver()
        slot = tf.compat.v1.train.load_variable(path, "emb/Adam")
    with tf.compat.v1.Session(graph=g) as sess:
        saver.restore(sess, path)
        got = sess.run([f"{n}/Read/ReadVariableOp:0" for n in names[:2]])
    for n, a, b in zip(names, got, want):
        np.testing.assert_array_equal(a, b, err_msg=n)
    assert slot.shape == (40, 4) and np.abs(slot).sum() > 0


def test_checkpoint_config_errors():
    with pytest.raises(ConfigError, match="checkpoint.every_steps"):
        load_config({"checkpoint": {"dir": "/tmp/x", "every_steps": 0}})
    with pytest.raises(ConfigError, match="checkpoint.dirr"):
        load_config({"checkpoint": {"dirr": "/tmp/x"}})
