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
A server can be shared by every launcher on the machine that runs many
jobs (a sweep, a test suite): `Forker(env, share=True)` also listens on a
socket of its own directory (`address`), and a launcher whose environment
names it in PARALLAX_NG_FORK_SERVER asks that server for its tasks
(`Forker.shared`) instead of starting one, sparing each job TensorFlow's
import. It does only where the server's interpreter and the variables an
interpreter or TensorFlow's import read (PYTHON*, TF_* but
TF_USE_LEGACY_KERAS) are the launcher's, else it starts its own. A
launcher's tasks end when it goes away, as with a server of its own.
"""
from __future__ import annotations

import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

READY_SECONDS = 300.0     # the server's import of TensorFlow, on a busy machine
MESSAGE = 1 << 20         # largest request (argv and environment) in bytes
SHARED_ENV = "PARALLAX_NG_FORK_SERVER"     # a shared server's address


TASK_READS = ("TF_USE_LEGACY_KERAS", "TF_NUM_INTEROP_THREADS", "TF_NUM_INTRAOP_THREADS")


def import_env(env: dict) -> dict:
    """The variables of `env` that an interpreter's start or TensorFlow's
    import read, which a task forked from a server takes from the server's
    environment (tf.keras resolves in the task: TF_USE_LEGACY_KERAS is not
    among them; nor the thread pools' sizes, read when a session makes
    them)."""
    return {k: v for k, v in env.items() if k.startswith(("PYTHON", "TF_"))
            and k not in TASK_READS}


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

    def __init__(self, env: dict, share: bool = False, connected: socket.socket | None = None):
        """A server of its own, started with `env` (with `share`, others
        may connect at `address`); or, `connected`, a shared server's."""
        self.process, self.address, self._dir = None, "", ""
        if connected is not None:
            self.sock = connected
        else:
            listener = None
            if share:    # bound here: launchers may connect while the server starts
                self._dir = tempfile.mkdtemp(prefix="parallax_ng_fork-")
                self.address = os.path.join(self._dir, "socket")
                listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
                listener.bind(self.address)
                listener.listen(64)
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
            self.sock = ours
            fds = [theirs.fileno()] + ([listener.fileno()] if listener else [])
            self.process = subprocess.Popen(
                [sys.executable, "-c", _SERVER, *map(str, fds)], env=env, pass_fds=fds,
                start_new_session=True, stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            theirs.close()
            if listener is not None:
                listener.close()
        self.failed: str | None = None
        self.said = False          # the launcher has told why it starts processes instead
        self._ready = threading.Event()
        self._lock = threading.Lock()
        self._started: dict[int, tuple[threading.Event, list]] = {}   # request -> reply
        self._tasks: dict[int, Forked] = {}
        self._next = 0
        if connected is not None:
            self._ready.set()
        threading.Thread(target=self._read, name="parallax_ng fork server", daemon=True).start()

    @classmethod
    def shared(cls, env: dict) -> Forker | None:
        """The server `env` names in PARALLAX_NG_FORK_SERVER, where its
        interpreter and its import's variables are `env`'s; else None."""
        address = env.get(SHARED_ENV)
        if not address:
            return None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            sock.settimeout(READY_SECONDS)       # it may still be importing TensorFlow
            sock.connect(address)
            hello = json.loads(sock.recv(MESSAGE) or b"{}")
            sock.settimeout(None)
        except (OSError, ValueError):
            sock.close()
            return None
        if hello.get("executable") != sys.executable or hello.get("env") != import_env(env):
            sock.close()
            return None
        return cls(env, connected=sock)

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
        if self.process is not None:
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.sock.close()
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)

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
           "m = u.module_from_spec(s); s.loader.exec_module(m); "
           "m.main(*map(int, sys.argv[1:]))")


def main(fd: int, listening: int = -1) -> None:
    forked = serve(fd, listening)
    if forked is not None:
        become(*forked)


def _send(sock: socket.socket, message: dict) -> None:
    try:
        sock.send(json.dumps(message).encode())
    except OSError:         # a launcher gone: its tasks are being killed
        pass


def serve(fd: int, listening: int = -1):
    """Import TensorFlow, then fork a task for each request until the
    launcher that started it closes its end (with a `listening` socket, also
    for the launchers that connect there; one's tasks are killed when it
    goes). Returns only in a child: the request it runs."""
    import importlib
    owner = socket.socket(fileno=fd)
    listener = socket.socket(fileno=listening) if listening >= 0 else None
    hello = {"ready": os.getpid(), "executable": sys.executable,
             "env": import_env(dict(os.environ))}     # as it was for the import
    try:
        importlib.import_module("tensorflow")     # what every task would import
    except BaseException as e:       # the launcher starts processes instead
        _send(owner, {"failed": f"importing TensorFlow: {type(e).__name__}: {e}"})
        return None
    _send(owner, {"ready": os.getpid()})
    clients: dict[socket.socket, set[int]] = {owner: set()}    # launcher -> its tasks
    while True:
        waiting = list(clients) + ([listener] if listener else [])
        readable, _, _ = select.select(waiting, [], [], 0.1)
        _reap(clients)
        for sock in readable:
            if sock is listener:
                conn, _ = listener.accept()
                clients[conn] = set()
                _send(conn, hello)
                continue
            try:
                data, fds, _, _ = socket.recv_fds(sock, MESSAGE, 2)
            except OSError:
                data, fds = b"", []
            if not data:                          # the launcher is gone
                for pid in clients.pop(sock):
                    _kill_group(pid)
                sock.close()
                if sock is owner:
                    for pid in set().union(*clients.values()):
                        _kill_group(pid)
                    return None
                continue
            request = json.loads(data)
            if threading.active_count() != 1:
                for f in fds:
                    os.close(f)
                _send(sock, {"failed": f"{threading.active_count()} threads in the fork server"})
                continue
            pid = os.fork()
            if pid == 0:
                for conn in [*clients, *([listener] if listener else [])]:
                    conn.close()
                return request, fds
            for f in fds:
                os.close(f)
            clients[sock].add(pid)
            _send(sock, {"started": request["id"], "pid": pid, "argv": request["argv"]})


def _reap(clients: dict) -> None:
    """Report every child that ended to the launcher that asked for it
    (a gone launcher's are reaped unreported)."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        for sock, children in clients.items():
            if pid in children:
                children.discard(pid)
                _send(sock, {"exited": pid, "code": os.waitstatus_to_exitcode(status)})
                break


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
