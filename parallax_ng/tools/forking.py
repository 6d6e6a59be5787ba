"""Fork server: start a job's tasks on this machine from one process that
has imported TensorFlow, instead of each task importing it again.

Importing TensorFlow costs a process 4-5 s of CPU; a 2-worker + 1-server
job paid it three times on every start and restart. `Forker` starts one
process (this file run by `python -c`, parallax_ng not imported) that imports
TensorFlow and then, for each task, forks a child that becomes the task:
its own session and process group, stdin from /dev/null, stdout and
stderr on pipes the launcher reads, the task's environment and working
directory, `sys.argv` and `sys.path[0]` as `python SCRIPT ARGS` or
`python -m MODULE ARGS` would set them, then the script or module runs as
`__main__` and the interpreter exits as it would after it (exit code,
traceback, atexit handlers).

Requires: the launcher's environment for the server, the same as every
local task's but for parallax_ng's own variables (a job's tasks differ
only there); TensorFlow's import leaves one Python thread (checked before
every fork: with more, the server stops forking and the launcher starts
processes as before). Only `import tensorflow` happens before the fork:
`tf.keras` still resolves in the task (TensorFlow routes it when it is
first used), so a script that sets TF_USE_LEGACY_KERAS before using it
gets tf_keras as in a process of its own; variables TensorFlow reads while
it imports (TF_CPP_MIN_LOG_LEVEL for the import's own lines) take the
launcher's values. numpy's global generator is reseeded in every task (the
`random` module reseeds itself after a fork).
Guarantees: `Forker.spawn` returns a `Forked`, which the launcher uses as a
`subprocess.Popen` (pid, poll, wait, returncode as Popen gives it, stdout
and stderr pipes); the task's pid is its process group, so signals to the
group reach it as before. The server reaps its children and reports each
exit; when the launcher goes away (its end of the socket closes), the
server kills every task it started and exits. A server that fails to
start, or dies, makes `spawn` return None (the launcher then starts the
task as a process of its own); tasks it had started are killed and end
with -SIGKILL.
"""
from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading

READY_SECONDS = 300.0     # the server's import of TensorFlow, on a busy machine
MESSAGE = 1 << 20         # largest request (argv and environment) in bytes


class Forked:
    """A task the fork server started, seen as a subprocess.Popen."""

    def __init__(self, pid: int, args: list[str], stdout, stderr):
        self.pid, self.args = pid, args
        self.stdout, self.stderr = stdout, stderr
        self.returncode: int | None = None
        self._ended = threading.Event()

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._ended.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def _end(self, code: int) -> None:
        self.returncode = code
        self._ended.set()


class Forker:
    """The launcher's side: the server process, its requests and reports."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock = ours
        self.process = subprocess.Popen(
            [sys.executable, "-c", _SERVER, str(theirs.fileno())], env=env,
            pass_fds=(theirs.fileno(),), start_new_session=True, stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        theirs.close()
        self.failed: str | None = None
        self.said = False          # the launcher has told why it starts processes instead
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._started: dict[int, tuple[threading.Event, list]] = {}   # request -> reply
        self._tasks: dict[int, Forked] = {}
        self._next = 0
        threading.Thread(target=self._read, name="parallax_ng fork server", daemon=True).start()

    def spawn(self, argv: list[str], env: dict, script: str = "",
              module: str = "", cwd: str | None = None) -> Forked | None:
        """Fork a task running `script` (or `module`) with `argv` and `env`
        in `cwd` (the caller's working directory when None); None when the
        server cannot (the caller starts a process)."""
        if not self._ready.wait(READY_SECONDS) or self.failed:
            return None
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        done, reply = threading.Event(), []
        with self._lock:
            self._next += 1
            ident = self._next
            self._started[ident] = (done, reply)
        request = {"id": ident, "argv": argv, "env": env, "cwd": cwd or os.getcwd(),
                   "script": script, "module": module}
        try:
            socket.send_fds(self.sock, [json.dumps(request).encode()], [out_w, err_w])
        except OSError as e:
            self._fail(f"the fork server cannot be reached: {e}")
        finally:
            os.close(out_w)
            os.close(err_w)
        if not done.wait(READY_SECONDS) or not reply:
            os.close(out_r)
            os.close(err_r)
            return None
        task = reply[0]
        task.stdout, task.stderr = os.fdopen(out_r, "rb"), os.fdopen(err_r, "rb")
        return task

    def close(self) -> None:
        """Stop the server (it kills any task it started that still runs)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        try:
            self.process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.sock.close()

    def _read(self) -> None:
        while True:
            try:
                data = self.sock.recv(MESSAGE)
            except OSError:
                data = b""
            if not data:
                self._fail("the fork server ended")
                return
            message = json.loads(data)
            if "ready" in message:
                self._ready.set()
            elif "failed" in message:     # it forks no more; what it started runs on
                self._fail(message["failed"], kill=False)
            elif "started" in message:
                task = Forked(message["pid"], message["argv"], None, None)
                with self._lock:
                    self._tasks[task.pid] = task
                    done, reply = self._started.pop(message["started"])
                reply.append(task)
                done.set()
            elif "exited" in message:
                with self._lock:
                    task = self._tasks.pop(message["exited"], None)
                if task is not None:
                    task._end(message["code"])

    def _fail(self, why: str, kill: bool = True) -> None:
        """No more tasks from the server; with `kill` (the server is gone,
        nothing reports their ends), those it started are killed."""
        with self._lock:
            self.failed = self.failed or why
            tasks = list(self._tasks.values()) if kill else []
            if kill:
                self._tasks = {}
            waiting, self._started = list(self._started.values()), {}
        for task in tasks:
            _kill_group(task.pid)
            task._end(-signal.SIGKILL)
        for done, _ in waiting:
            done.set()
        self._ready.set()


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


# -- the server process --------------------------------------------------

# The server runs this file without importing parallax_ng (whose import
# starts a task's heartbeat, parallax_ng/runtime/heartbeat.py): a task
# imports parallax_ng itself, with its own environment.
_SERVER = ("import importlib.util as u, sys; "
           f"s = u.spec_from_file_location('parallax_ng_fork_server', {__file__!r}); "
           "m = u.module_from_spec(s); s.loader.exec_module(m); m.main(int(sys.argv[1]))")


def main(fd: int) -> None:
    forked = serve(fd)
    if forked is not None:
        become(*forked)


def serve(fd: int):
    """Import TensorFlow, then fork a task for each request until the
    launcher closes its end. Returns only in a child: the request it runs."""
    import importlib
    sock = socket.socket(fileno=fd)
    send = lambda message: sock.send(json.dumps(message).encode())  # noqa: E731
    try:
        importlib.import_module("tensorflow")     # what every task would import
    except BaseException as e:       # the launcher starts processes instead
        send({"failed": f"importing TensorFlow: {type(e).__name__}: {e}"})
        return None
    send({"ready": os.getpid()})
    children: set[int] = set()
    while True:
        readable, _, _ = select.select([sock], [], [], 0.1)
        _reap(children, send)
        if not readable:
            continue
        data, fds, _, _ = socket.recv_fds(sock, MESSAGE, 2)
        if not data:                          # the launcher is gone
            for pid in children:
                _kill_group(pid)
            return None
        request = json.loads(data)
        if threading.active_count() != 1:
            for f in fds:
                os.close(f)
            send({"failed": f"{threading.active_count()} threads in the fork server"})
            continue
        pid = os.fork()
        if pid == 0:
            sock.close()
            return request, fds
        for f in fds:
            os.close(f)
        children.add(pid)
        send({"started": request["id"], "pid": pid, "argv": request["argv"]})


def _reap(children: set[int], send) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            children.clear()
            return
        if pid == 0:
            return
        children.discard(pid)
        send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def become(request: dict, fds: list[int]) -> None:
    """In the forked child: turn into the task and run it as `__main__`."""
    os.setsid()
    stdin = os.open(os.devnull, os.O_RDONLY)
    for target, fd in zip((0, 1, 2), (stdin, *fds)):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = list(request["argv"])
    code, main = _main_module(request["module"], request["script"], request["cwd"])
    try:
        exec(code, main.__dict__)
    except (SystemExit, KeyboardInterrupt):
        raise
    except BaseException as e:
        # the traceback from the script's frames on, as `python SCRIPT` prints it
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code is not code:
            tb = tb.tb_next
        if tb is not None:
            e.__traceback__ = tb          # what the excepthook prints
        sys.excepthook(type(e), e, e.__traceback__)
        raise SystemExit(1) from None


def _main_module(module: str, script: str, cwd: str):
    """The code to run and the `__main__` module it runs in, which stays
    in sys.modules until the interpreter ends (as in `python SCRIPT`, so
    what the script's globals hold lives until its atexit handlers ran)."""
    import importlib.machinery
    import importlib.util
    import types
    main = types.ModuleType("__main__")
    if module:                        # as `python -m MODULE` does
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.submodule_search_locations is not None:
            module += ".__main__"            # a package runs its __main__
            spec = importlib.util.find_spec(module)
        if spec is None or spec.loader is None:
            raise SystemExit(f"{sys.executable}: No module named {module}")
        code = spec.loader.get_code(module)
        main.__dict__.update(__spec__=spec, __file__=spec.origin, __loader__=spec.loader,
                             __package__=module.rpartition(".")[0], __cached__=None)
        sys.argv[0] = spec.origin
        sys.path[0] = cwd
    else:
        with open(script, "rb") as f:
            code = compile(f.read(), script, "exec", dont_inherit=True)
        main.__dict__.update(__file__=script, __cached__=None, __package__=None,
                             __spec__=None,
                             __loader__=importlib.machinery.SourceFileLoader("__main__", script))
        sys.path[0] = os.path.dirname(os.path.realpath(script))
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    return code, main
