"""`python SCRIPT ARGS` (or `python -m MODULE ARGS`) for the tests, forked
from one fork server per test process (parallax_ng/tools/forking.py, as the
launcher starts a job's tasks) instead of a new interpreter importing
TensorFlow again: 4-5 s of CPU saved on each of the scripts and commands
the suite runs. `run` takes what subprocess.run takes here and returns its
CompletedProcess (text output); where the server cannot fork, it runs the
command as a process of its own. `share` makes the server the one every
`parallax-ng run` the test process starts asks for its tasks (the
launcher's PARALLAX_NG_FORK_SERVER), instead of each job starting one."""
import atexit
import os
import signal
import subprocess
import sys
import threading

from parallax_ng.tools.forking import SHARED_ENV, Forker
from task_env import TASK_PATH

# as the tests start jobs, with what the launcher adds for its tasks
ENV = dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2", PYTHONUNBUFFERED="1")
_forker: list[Forker] = []


def run(cmd: list[str], env: dict | None = None, cwd=None, timeout: float = 600,
        input: str | None = None) -> subprocess.CompletedProcess:
    """cmd is [sys.executable, SCRIPT, *args] or [sys.executable, "-m",
    MODULE, *args]; env is the whole environment (ENV when None)."""
    env = ENV if env is None else env
    task = None
    if cmd[0] == sys.executable and input is None:
        module = cmd[2] if cmd[1] == "-m" else ""
        script = "" if module else os.path.abspath(os.path.join(cwd or "", cmd[1]))
        argv = [module, *cmd[3:]] if module else cmd[1:]
        task = _server().spawn(argv, dict(env), script=script, module=module,
                               cwd=str(cwd) if cwd else None)
    if task is None:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              env=env, cwd=cwd, input=input)
    out: dict[str, bytes] = {}
    readers = [threading.Thread(target=lambda n=n, f=f: out.__setitem__(n, f.read()))
               for n, f in (("out", task.stdout), ("err", task.stderr))]
    for reader in readers:
        reader.start()
    try:
        code = task.wait(timeout)
    except subprocess.TimeoutExpired:
        os.killpg(task.pid, signal.SIGKILL)
        task.wait(30)
        raise
    finally:
        for reader in readers:
            reader.join(30)
        task.stdout.close()
        task.stderr.close()
    return subprocess.CompletedProcess(cmd, code, out.get("out", b"").decode(errors="replace"),
                                       out.get("err", b"").decode(errors="replace"))


def share() -> None:
    """Start the server now and name it to the launchers this process starts."""
    os.environ[SHARED_ENV] = _server().address


def _server() -> Forker:
    if not _forker:
        _forker.append(Forker(ENV, share=True))
        atexit.register(_forker[0].close)
    return _forker[0]
