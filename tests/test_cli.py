import json
import os
import shutil
import subprocess
import sys

import tensorflow as tf

from models import embedding_regression
from parallax_ng.tools import cli
from task_env import TASK_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(ROOT, "examples", "linear_regression.py")


def test_plan_of_a_script(capsys):
    resources = os.path.join(ROOT, "configs", "resources_2cpu.yaml")
    assert cli.main(["plan", EXAMPLE, "-r", resources]) == 0
    out = capsys.readouterr().out
    assert "run_option=hybrid replicas=2" in out and "allreduce" in out


def test_plan_json_of_a_meta_graph(tmp_path, capsys):
    g, _ = embedding_regression(4, "adam")
    path = str(tmp_path / "m.meta")
    with g.as_default():
        tf.compat.v1.train.export_meta_graph(filename=path)
    cfg = os.path.join(ROOT, "configs", "ps.yaml")
    assert cli.main(["plan", path, "--json", "-c", cfg, "-r", os.path.join(ROOT, "configs",
                                                                  "resources_2cpu.yaml")]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["run_option"] == "ps" and plan["variables"]["emb"]["method"] == "ps"


def test_diff_writes_text_dot_and_html(tmp_path, capsys):
    out = str(tmp_path / "d")
    assert cli.main(["diff", EXAMPLE, "--out", out, "--batch", "16"]) == 0
    assert "replicate" in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ["diff.dot", "diff.html", "diff.txt"]


def test_errors_are_reported_not_raised(tmp_path, capsys):
    assert cli.main(["plan", str(tmp_path / "missing.meta")]) == 2
    assert "does not exist" in capsys.readouterr().err
    bad = tmp_path / "bad.yaml"
    bad.write_text("run_option: nccl\n")
    assert cli.main(["plan", EXAMPLE, "-c", str(bad)]) == 2
    assert "nccl" in capsys.readouterr().err


def test_console_script_is_installed():
    exe = shutil.which("parallax-ng") or os.path.join(os.path.dirname(sys.executable),
                                                      "parallax-ng")
    assert os.access(exe, os.X_OK), "pip install -e . installs the parallax-ng command"
    done = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "plan" in done.stdout and "diff" in done.stdout
    assert "after `--`" in done.stdout


def test_help_does_not_import_tensorflow():
    code = ("import sys\nfrom parallax_ng.tools import cli\ntry:\n    cli.main(['run', '--help'])\n"
            "except SystemExit:\n    pass\nprint('tensorflow' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=dict(os.environ, PYTHONPATH=TASK_PATH))
    assert done.stdout.strip().endswith("False") and "--chief-only" in done.stdout


def test_simulate_is_arithmetic_without_tensorflow(tmp_path):
    """`parallax-ng simulate` neither imports TensorFlow nor prints its banner."""
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"forward_time": 0.01, "layers": [
        {"name": "a", "bytes": 10**6, "backward_time": 0.005},
        {"name": "b", "bytes": 2 * 10**6, "backward_time": 0.004}]}))
    code = ("import sys\nfrom parallax_ng.tools import cli\n"
            f"cli.main(['simulate', '--profile', {str(profile)!r}, '--nodes', '2', "
            "'--alpha', '1e-4', '--beta', '1e-9', '--strategies', 'wfbp,mgwfbp,bfb:2,ps:2'])\n"
            "print('tensorflow' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=TASK_PATH)
    env.pop("TF_CPP_MIN_LOG_LEVEL", None)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, env=env)
    assert done.stdout.strip().endswith("False") and "bfb:2" in done.stdout, done.stderr
    assert done.stderr == ""


def test_plan_of_a_job_names_where_its_gradient_order_comes_from(capsys):
    res = os.path.join(ROOT, "configs", "resources_2workers_1ps.yaml")
    assert cli.main(["plan", os.path.join(ROOT, "examples", "lm_small.py"), "-r", res,
                     "-c", os.path.join(ROOT, "configs", "hybrid.yaml")]) == 0
    out = capsys.readouterr().out
    assert "packed in" not in out
    assert "alpha: the share of a sparse variable's rows" in out


def test_script_arguments_with_and_without_double_dash(tmp_path):
    script = tmp_path / "argv.py"
    script.write_text("import json, sys\nopen(sys.argv[1], 'w').write(json.dumps(sys.argv[2:]))\n")
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n  - address: 127.0.0.1\n    devices: [cpu:0]\n")
    for args in (["--steps", "10", "-x"], ["--", "--steps", "10", "-x"]):
        out = tmp_path / "argv.json"
        assert cli.main(["run", str(script), "-r", str(res), str(out), *args]) == 0
        assert json.loads(out.read_text()) == ["--steps", "10", "-x"]


def test_run_names_a_missing_script_before_starting_anything(tmp_path, capsys):
    res = tmp_path / "r.yaml"
    res.write_text("hosts:\n  - address: 127.0.0.1\n    devices: [cpu:0]\n")
    assert cli.main(["run", str(tmp_path / "nope.py"), "-r", str(res)]) == 2
    err = capsys.readouterr().err
    assert "nope.py" in err and "does not exist" in err and "started" not in err


def test_plan_of_a_job_prints_the_load_of_every_server(capsys):
    res = os.path.join(ROOT, "configs", "resources_2workers_2ps.yaml")
    assert cli.main(["plan", os.path.join(ROOT, "examples", "lm_small.py"), "-r", res]) == 0
    out = capsys.readouterr().out
    assert "(2 worker(s) x 1)" in out
    servers = [line for line in out.splitlines() if line.startswith("servers:")][0]
    assert "task:0/device:CPU:0" in servers and "task:1/device:CPU:0" in servers
    assert servers.count(" MB") == 2


def test_plan_of_a_layer_to_layer_config(capsys):
    """`parallax-ng plan` with config l2l prints how the model is cut."""
    script = os.path.join(ROOT, "examples", "transformer_stack.py")
    assert cli.main(["plan", script, "-r", os.path.join(ROOT, "configs",
                                                        "resources_accelerators.yaml"),
                     "-c", os.path.join(ROOT, "configs", "l2l.yaml"), "--",
                     "--layers", "2"]) == 0
    out = capsys.readouterr().out
    assert "layer-to-layer: worker 0 of 1, 2 replicas" in out and "stash on host" in out
    for segment in ("pre", "layer_0", "layer_1", "post"):
        assert segment in out
