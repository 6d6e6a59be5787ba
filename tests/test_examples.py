"""The shipped examples run end to end and learn."""
import os
import re
import subprocess
import sys

import forked
from task_env import TASK_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(script, *args):
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=TASK_PATH)
    done = forked.run([sys.executable, os.path.join(ROOT, "examples", script), *args],
                      env=env, timeout=600)
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


def test_readme_docs_and_examples_name_only_shipped_config_files():
    pages = ["README.md"] + [os.path.join("docs", f) for f in os.listdir(
        os.path.join(ROOT, "docs")) if f.endswith(".md")]
    texts = [open(os.path.join(ROOT, p)).read() for p in pages] + [
        open(os.path.join(ROOT, "examples", f)).read()
        for f in os.listdir(os.path.join(ROOT, "examples")) if f.endswith(".py")]
    named = {m for t in texts for m in re.findall(r"configs/[\w.]+\.yaml", t)}
    assert "configs/resources_2workers_1ps.yaml" in named
    for path in named:
        assert os.path.exists(os.path.join(ROOT, path)), path


def test_the_jobs_page_resource_file_is_the_shipped_one():
    page = open(os.path.join(ROOT, "docs", "jobs.md")).read()
    block = page.split("`configs/resources_2workers_1ps.yaml`:\n\n```yaml\n")[1].split("```")[0]
    with open(os.path.join(ROOT, "configs", "resources_2workers_1ps.yaml")) as f:
        assert f.read() == block


def test_lm_small_with_a_server_as_the_readme_runs_it():
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=TASK_PATH)
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", os.path.join(ROOT, "examples",
                                                                      "lm_small.py"),
         "-r", os.path.join(ROOT, "configs", "resources_2workers_1ps.yaml"), "--steps", "40",
         "--log-every", "20", "--vocab", "2000", "--words", "20000", "--batch", "32"],
        capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"\[worker 0\] step +\d+ +loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], done.stdout
    assert "servers: /job:ps/replica:0/task:0/device:CPU:0" in done.stdout


def test_lm_small_with_its_table_by_alltoall_beside_a_server(tmp_path):
    """A plan `auto` may try: the embedding by alltoall, the softmax's rows
    on the server, the dense layers by the ring, so every step is two
    session runs at once. The alltoall lookup's row shape crosses from the
    server run; TensorFlow's rewrites fold the Reshape that reads it into
    the model's own, and the element stayed queued: step 2 waited for good
    until dequeues became targets of their run (step_parts.py)."""
    config = tmp_path / "config.yaml"
    config.write_text("run_option: auto\nvariable_methods: {embedding: alltoall, "
                      "softmax/w: ps, softmax/b: ps, hidden/w: allreduce, hidden/b: allreduce, "
                      "project/w: allreduce, project/b: allreduce}\n"
                      "communication: {timeout_seconds: 60}\n")
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=TASK_PATH)
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", os.path.join(ROOT, "examples",
                                                                      "lm_small.py"),
         "-r", os.path.join(ROOT, "configs", "resources_2workers_1ps.yaml"), "--steps", "20",
         "--log-every", "10", "--vocab", "2000", "--words", "20000", "--batch", "32",
         "--config", str(config)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "[worker 1] schedule: a step with collectives runs them in a session run of " \
        "their own" in done.stdout
    losses = [float(x) for x in
              re.findall(r"\[worker 0\] step +\d+ +loss (\d+\.\d+)", done.stdout)]
    assert len(losses) == 3 and losses[-1] < losses[0], done.stdout


def test_lm_small_repeats_itself():
    args = ["--steps", "20", "--log-every", "10", "--vocab", "2000", "--words", "20000",
            "--batch", "32", "--resources", os.path.join(ROOT, "configs", "resources_2cpu.yaml")]
    first, second = (re.findall(r"loss (\d+\.\d+)", run("lm_small.py", *args)) for _ in range(2))
    assert len(first) == 3 and first == second


def test_transformer_stack_learns_on_two_replicas():
    out = run("transformer_stack.py", "--steps", "100",
              "--resources", os.path.join(ROOT, "configs", "resources_2cpu.yaml"))
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], out


def test_transformer_stack_learns_layer_by_layer_with_the_shipped_configs():
    """The README's L2L command: configs/l2l.yaml on two stand-in devices."""
    out = run("transformer_stack.py", "--steps", "100", "--layers", "3",
              "--resources", os.path.join(ROOT, "configs", "resources_accelerators.yaml"),
              "--config", os.path.join(ROOT, "configs", "l2l.yaml"))
    assert "2 replicas" in out
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", out)]
    assert len(losses) == 4 and losses[-1] < 0.8 * losses[0], out


def test_keras_fit_learns_on_two_replicas():
    out = run("keras_fit.py", "--epochs", "2",
              "--resources", os.path.join(ROOT, "configs", "resources_2cpu.yaml"))
    found = re.search(r"val_accuracy (\d\.\d+) \(2 replicas; embedding by (\w+)\)", out)
    assert found and float(found.group(1)) > 0.9, out[-2000:]
