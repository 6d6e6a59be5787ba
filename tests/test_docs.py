"""Every command in the README and docs/ is run by a test: here (as written,
or with fewer steps where it trains long), or by the test the table names,
whose source runs the same script with the same files. A command added to
the docs without a row here fails `test_every_documented_command_is_run`.
The README's Python example runs as written."""
import glob
import json
import os
import re
import subprocess
import sys

import pytest
import forked
from task_env import TASK_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2")
CLI = [sys.executable, "-m", "parallax_ng"]

# command (as the docs write it, comments and line breaks dropped) -> who runs it
BY_OTHERS = {
    "python3 -m venv .venv && . .venv/bin/activate && pip install -e . && "
    "python examples/lm_small.py": "here",
    'python3 -m venv .venv && . .venv/bin/activate && pip install -e ".[test]" && '
    "python -m pytest -q -n 2 --dist loadfile": ".ci/run (CI runs this command on a clean clone)",
    "parallax-ng run examples/lm_small.py -r configs/resources_2workers_1ps.yaml --steps 300":
        "test_examples.py::test_lm_small_with_a_server_as_the_readme_runs_it",
    "parallax-ng run examples/linear_regression.py -r configs/resources_2workers.yaml "
    "--steps 100": "here",
    "horovodrun --gloo -np 2 -H localhost:2 python train.py":
        "test_horovod.py::test_horovod_workers_match_one_device",
    'pip install tensorflow-cpu==2.18.1 "cmake<4"': ".ci/horovod_env",
    "HOROVOD_WITH_TENSORFLOW=1 HOROVOD_WITH_GLOO=1 HOROVOD_WITHOUT_MPI=1 "
    "HOROVOD_WITHOUT_PYTORCH=1 HOROVOD_WITHOUT_MXNET=1 pip install --no-build-isolation "
    "horovod==0.28.1": ".ci/horovod_env",
    "pip install --no-deps -e . && TF_USE_LEGACY_KERAS=0 python -m pytest -q -m horovod "
    "tests/test_horovod.py": ".ci/run (CI runs it in the Horovod environment)",
    "python examples/transformer_stack.py --layers 12 --resources "
    "configs/resources_accelerators.yaml --config configs/l2l.yaml":
        "test_examples.py::test_transformer_stack_learns_layer_by_layer_with_the_shipped_configs",
    "parallax-ng run examples/lm_small.py -r configs/resources_2workers_1ps.yaml --timeline "
    "lm.json -- --steps 30": "test_timeline.py::test_a_job_s_timeline_merges_every_task",
    "parallax-ng timeline lm.json --png lm.png":
        "test_timeline.py::test_in_process_steps_traced_after_the_skipped_ones",
    "parallax-ng plan examples/lm_small.py": "here",
    "parallax-ng plan model.meta -c configs/ps.yaml --json": "here",
    "parallax-ng plan examples/lm_small.py --profile 2": "here",
    "parallax-ng profile examples/lm_small.py -r configs/resources_2workers_1ps.yaml "
    "--out p.json": "here",
    "parallax-ng diff examples/lm_small.py --out diff/ --batch 128": "here",
    "parallax-ng simulate --profile profiles/resnet50-k80.json --nodes 64 --alpha 45.26e-6 "
    "--beta 8e-10": "here",
}
SHELL_BLOCK = re.compile(r"```(?:bash|sh)\n(.*?)```", re.S)
SIMULATE_BLOCK = re.compile(r"```\n(parallax-ng simulate [^\n]*)\n```")


def documented_commands() -> list[str]:
    out = []
    for path in ["README.md"] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))):
        text = open(os.path.join(ROOT, path)).read()
        blocks = SHELL_BLOCK.findall(text) + SIMULATE_BLOCK.findall(text)
        for block in blocks:
            if block.startswith("#!"):   # a whole script: its own test runs it
                assert path.endswith("orchestrators.md"), path   # tests/test_orchestrators.py
                continue
            joined = re.sub(r"\\\n\s*", "", block)
            for line in joined.splitlines():
                line = re.sub(r"\s+#.*$", "", line).strip()
                if line and not line.startswith("#"):
                    out.append(re.sub(r"\s+", " ", line))
    return out


def test_every_documented_command_is_run():
    commands = documented_commands()
    assert len(commands) >= 12
    missing = [c for c in commands if c not in BY_OTHERS]
    assert not missing, f"no test runs {missing}; add a row to BY_OTHERS"
    for command, who in BY_OTHERS.items():
        assert command in commands, f"{command!r} is no longer documented"
        if "::" in who:             # that test runs the command's script with its files
            module, name = who.split("::")
            source = open(os.path.join(ROOT, "tests", module)).read()
            assert f"def {name}(" in source, who
            body = source.split(f"def {name}(")[1].split("\ndef ")[0]
            for part in re.findall(r"(?:examples|configs)/([\w.]+)", command):
                assert part.split(".")[0] in body or part in source, (who, part)
        elif who != "here":
            assert os.path.exists(os.path.join(ROOT, who.split()[0])), who


def run(command: list[str], cwd=ROOT, timeout=300, fork=False) -> subprocess.CompletedProcess:
    """The command as a process of its own; with `fork`, forked from the
    tests' fork server (tests/forked.py: a command that runs no job)."""
    done = (forked.run(command, env=ENV, cwd=cwd, timeout=timeout) if fork else
            subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                           env=ENV, cwd=cwd))
    assert done.returncode == 0, (command, done.stderr[-3000:])
    return done


def test_the_main_example_as_the_readme_runs_it():
    """`python examples/lm_small.py` (20 steps instead of its default)."""
    out = run([sys.executable, "examples/lm_small.py", "--steps", "20"]).stdout
    assert "loss" in out


def test_the_readme_python_example_runs_as_written(tmp_path):
    readme = open(os.path.join(ROOT, "README.md")).read()
    code = re.search(r"```python\n(.*?)```", readme, re.S).group(1)
    script = tmp_path / "example.py"
    script.write_text(code)
    out = run([sys.executable, str(script)], cwd=tmp_path).stdout
    w = [float(x) for x in re.findall(r"-?\d+\.\d*", out.split(" on ")[0])]
    assert len(w) == 3 and abs(w[0] - 2) < 0.05 and abs(w[1] + 3) < 0.05, out
    assert out.strip().endswith("replicas")


def test_the_job_of_the_jobs_page():
    done = run(CLI + ["run", "examples/linear_regression.py", "-r",
                      "configs/resources_2workers.yaml", "--steps", "100"])
    assert "[worker 0] step  100" in done.stdout


def test_the_tools_page_commands(tmp_path):
    """plan (of a script, of an exported MetaGraphDef, after 2 profiled
    steps), profile of a job, diff, simulate: as the page writes them, from a directory
    holding the repository's examples, configs and profiles."""
    for name in ("examples", "configs", "profiles"):
        os.symlink(os.path.join(ROOT, name), tmp_path / name)
    plan = run(CLI + ["plan", "examples/lm_small.py"], cwd=tmp_path, fork=True).stdout
    assert "embedding" in plan and "MB/step/replica" in plan
    export = ("import sys; sys.argv = ['lm_small.py']\n"
              "import tensorflow as tf\nsys.path.insert(0, 'examples')\nimport lm_small\n"
              "graph, *_ = lm_small.build(lm_small.arguments([]))\n"
              "with graph.as_default():\n"
              "    tf.compat.v1.train.export_meta_graph('model.meta')\n")
    run([sys.executable, "-c", export], cwd=tmp_path)
    meta = json.loads(run(CLI + ["plan", "model.meta", "-c", "configs/ps.yaml", "--json"],
                          cwd=tmp_path, fork=True).stdout)
    assert meta["run_option"] == "ps"
    profiled = run(CLI + ["plan", "examples/lm_small.py", "--profile", "2"], cwd=tmp_path,
                   fork=True)
    assert "measured" in profiled.stdout
    run(CLI + ["profile", "examples/lm_small.py", "-r", "configs/resources_2workers_1ps.yaml",
               "--out", "p.json"], cwd=tmp_path)
    assert json.loads((tmp_path / "p.json").read_text())["layers"]
    diff = run(CLI + ["diff", "examples/lm_small.py", "--out", "diff/", "--batch", "128"],
               cwd=tmp_path, fork=True).stdout
    assert "wrote diff.txt, diff.dot, diff.html" in diff
    assert (tmp_path / "diff" / "diff.html").exists()
    simulated = run(CLI + ["simulate", "--profile", "profiles/resnet50-k80.json", "--nodes",
                           "64", "--alpha", "45.26e-6", "--beta", "8e-10"], cwd=tmp_path)
    assert "mgwfbp" in simulated.stdout


@pytest.mark.parametrize("page", ["README.md"] + sorted(
    os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md"))))
def test_links_between_pages_resolve(page):
    text = open(os.path.join(ROOT, page)).read()
    here = os.path.dirname(os.path.join(ROOT, page))
    for target in re.findall(r"\]\(([^)#]+\.md)(?:#[^)]*)?\)", text):
        assert os.path.exists(os.path.join(here, target)), (page, target)
