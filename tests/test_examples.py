"""The shipped examples run end to end and learn."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    done = subprocess.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                          capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def test_linear_regression_recovers_the_weights():
    out = run("linear_regression.py", "--steps", "100",
              "--resources", os.path.join(ROOT, "configs", "resources_2cpu.yaml"))
    assert "w = [ 2.  -3.   0.5] b = [1.] (2 replicas)" in out


def test_lm_small_loss_falls_in_every_run_option():
    for option in ("hybrid", "allreduce", "ps"):
        out = run("lm_small.py", "--steps", "60", "--log-every", "20", "--vocab", "2000",
                  "--words", "20000", "--batch", "32", "--run-option", option,
                  "--resources", os.path.join(ROOT, "configs", "resources_2cpu.yaml"))
        losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
        assert len(losses) == 4 and losses[-1] < losses[0], (option, out)
