"""The import path of the processes the tests start (the tasks of jobs,
scripts, commands): the repository, then `no_matplotlib/`, where importing
matplotlib fails. Keras 3 imports matplotlib.pyplot as TensorFlow starts
when it is installed (the test extra installs it, for `parallax-ng timeline
--png`, which tests/test_timeline.py runs in the test process): 1.4 s of
CPU in each of the ~350 TensorFlow processes the suite starts, a fifth of
its CPU time, for plots none of them draws. The tasks run as they do where
matplotlib is not installed."""
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TASK_PATH = os.pathsep.join([ROOT, os.path.join(ROOT, "tests", "no_matplotlib")])


def run_script_job(tmp_path, text: str, servers: int = 0, args=(), workers: int = 2):
    """`text` written as a script and run by `parallax-ng run` as a job of
    `workers` workers x 1 device and `servers` parameter servers on
    127.0.0.1 (arguments `args` after `--`): the finished process."""
    import subprocess
    import sys
    script, path = tmp_path / "job_script.py", tmp_path / "resources.yaml"
    script.write_text(text)
    path.write_text("hosts:\n" + "  - address: 127.0.0.1\n    devices: [cpu:0]\n" * workers +
                    (f"ps: [{', '.join(['127.0.0.1'] * servers)}]\n" if servers else ""))
    return subprocess.run([sys.executable, "-m", "parallax_ng", "run", str(script), "-r",
                           str(path), "--", *map(str, args)], capture_output=True, text=True,
                          timeout=300,
                          env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
