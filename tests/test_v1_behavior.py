"""The numerical suites again, in one process that called
tf.compat.v1.disable_v2_behavior() first, as ported TF1 scripts do (v1
TensorShape, reference variables, v1 control flow, no eager execution)."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# layer-to-layer's parts (cuts, runner, stash) are here; its whole-model
# suite, test_l2l.py, runs once, with v2 behavior (CI time)
SUITES = ["test_equivalence.py", "test_v1_shapes.py", "test_keras_and_batchnorm.py",
          "test_queues.py", "test_randomness.py", "test_tutorials.py",
          "test_l2l_runner.py", "test_layers.py", "test_eps.py", "test_input_calls.py",
          "test_loss_scales.py", "test_accumulation.py"]


def test_numerical_suites_pass_under_disable_v2_behavior():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         # the job scripts call disable_v2_behavior themselves; device memory
         # in depth is a measurement, not numerics (tests/test_l2l.py runs it);
         # the equivalence cross on 2 replicas (4 replicas: with v2 behavior);
         # of the loss scales, the TF1 program's (reference variables); of the
         # accumulations, the TF1 graphs' (a v1 cond's reference accumulator)
         "-k", "not job and not device_memory_constant_in_depth and not "
               "(test_replicas_match_one_device and -4]) and not fit_skips and not "
               "custom_loop and not tf2_loop and not tf2_step and not sums_within_itself",
         *(os.path.join(ROOT, "tests", s) for s in SUITES)],
        capture_output=True, text=True, timeout=1500, cwd=ROOT,
        # the suites' tf.compat.v1.layers need tf_keras, whatever this process has
        env=dict(os.environ, PARALLAX_NG_TEST_V1_BEHAVIOR="1", TF_USE_LEGACY_KERAS="1"))
    assert done.returncode == 0, done.stdout[-6000:]
    passed = int(re.search(r"(\d+) passed", done.stdout).group(1))
    assert passed >= 100 and "failed" not in done.stdout.splitlines()[-1]
