import os
import sys

import pytest

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# tf.compat.v1.layers needs the Keras 2 package (tf_keras) under Keras 3.
os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
sys.path.insert(0, os.path.dirname(__file__))

# The usual first line of a ported TF1 script; test_v1_behavior.py runs
# suites in a process with this set (v1 TensorShape, reference variables,
# v1 control flow, no eager execution).
V1_BEHAVIOR = os.environ.get("PARALLAX_NG_TEST_V1_BEHAVIOR") == "1"
if V1_BEHAVIOR:
    import tensorflow as tf
    tf.compat.v1.disable_v2_behavior()



def pytest_configure(config):
    """One fork server per test process forks the scripts the tests run
    and the tasks of every job they launch (tests/forked.py); not in
    pytest-xdist's controller, which runs no test."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        import forked
        forked.share()
    # pytest-xdist's scheduler otherwise sorts the modules by their number
    # of tests, which undoes the order below: test_v1_behavior.py, one test
    # of 76 s, ran last, alone (the workers ended 75 s apart in CI).
    if getattr(config.option, "loadscopereorder", None):
        config.option.loadscopereorder = False

# The modules that take longest (minutes of jobs each) are collected first,
# so that `-n 2 --dist loadfile`, which hands modules to its two workers in
# collection order as they finish, does not leave one of them running a
# long module alone at the end of the run. Measured in a fresh-clone CI
# (seconds: 289 ... 45), longest first; the rest follow in name order.
LONGEST_FIRST = ["test_keras_fit.py", "test_cluster.py", "test_restarts.py",
                 "test_keras_examples.py", "test_tf2.py", "test_normalization.py",
                 "test_checkpoint.py", "test_tuning.py", "test_keras_train_steps.py",
                 "test_l2l.py", "test_equivalence.py", "test_tf1_losses.py",
                 "test_v1_behavior.py", "test_factors.py", "test_tutorials.py",
                 "test_state_sync.py", "test_prefetch.py", "test_examples.py",
                 "test_launch.py", "test_job_rows.py", "test_horizontal.py",
                 "test_fusion_buffers.py", "test_forking.py", "test_alltoall.py"]


def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


WATCHED = ("TF_", "KERAS", "PARALLAX_NG", "HOROVOD", "CUDA")


@pytest.fixture(autouse=True)
def environment_kept():
    """A test that sets TF_USE_LEGACY_KERAS (or another of these) in this
    process changes what later tests, and the processes they start, import:
    which later tests depends on how the run was split between workers. Set
    them with monkeypatch, which puts them back."""
    before = {k: v for k, v in os.environ.items() if k.startswith(WATCHED)}
    yield
    after = {k: v for k, v in os.environ.items() if k.startswith(WATCHED)}
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"the test left the environment changed: {changed}"
