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
