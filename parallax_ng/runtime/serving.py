"""Serving: what a job's parameter-server tasks do, and what passes between
its workers outside their training steps.

Requires: a ClusterInfo (parallax_ng/cluster.py) and the task's started
server. Guarantees: a parameter-server task `serve`s until every worker has
said it is done (`done_ops`, which a worker's runner runs at its `End`)
and their processes have ended (or LINGER_SECONDS more), or until no
worker has been reachable for the timeout; SIGTERM (a
preemption's notice) does not end it, it tells the launcher, whose workers
then checkpoint and finish. Where workers hold parts of tables that other
workers read (cut by columns), a worker's runner ends only once every
worker has reached its end (`leave_ops`), so none reads a part whose
process is gone. `share` gives worker
0's value to every other worker once, within the timeout.
"""
from __future__ import annotations

import json
import os
import weakref

from ..cluster import ClusterInfo

DONE_QUEUE = "parallax_ng/workers_done"   # on every server: one token per finished worker
LEAVE_QUEUE = "parallax_ng/workers_leaving"   # on every worker: one token per worker at its end
# how long a server serves on once every worker is done, while some worker's
# process is still up: a worker says it is done before its sessions close,
# and a session closed after its server is gone logs a gRPC error
LINGER_SECONDS = 30.0


def done_ops(graph, servers: list[str], workers: int, worker: int) -> list:
    """Ops (in `graph`) that tell every server this worker is done."""
    import tensorflow as tf
    ops = []
    with graph.as_default(), tf.compat.v1.name_scope("parallax/done/"):
        for device in servers:
            with tf.device(device):
                queue = tf.queue.FIFOQueue(workers, [tf.int32], shapes=[[]],
                                           shared_name=DONE_QUEUE)
                ops.append(queue.enqueue(worker))
    return ops


def leave_ops(graph, workers: int, worker: int) -> list:
    """Ops (in `graph`): this worker's token into every worker's queue, and
    the last, taking one token of every worker from this worker's queue."""
    import tensorflow as tf
    puts = []
    with graph.as_default(), tf.compat.v1.name_scope("parallax/leave/"):
        for k in range(workers):
            with tf.device(f"/job:worker/replica:0/task:{k}/device:CPU:0"):
                queue = tf.queue.FIFOQueue(workers, [tf.int32], shapes=[[]],
                                           shared_name=LEAVE_QUEUE)
                puts.append(queue.enqueue(worker))
                if k == worker:
                    take = queue.dequeue_many(workers)
    return puts + [take]


class End:
    """What a job's worker does at its end, once: at its runner's close, or
    when the runner is collected or the process ends (after the runner's
    `save_final`, registered later): wait until every worker has reached
    its end where others read this worker's parts (`leave_ops`, within the
    run timeout), then tell the servers it is done (`done_ops`) unless
    `tell_servers` did (idle servers stop before the first step)."""

    def __init__(self):
        self._final, self._told = None, False

    def bind(self, runner, program) -> None:
        """For the runner's session of `program` (again after a new plan)."""
        if self._final is not None:
            self._final.detach()
        done = None if self._told else program.done
        self._final = weakref.finalize(runner, _end, runner.session, done, program.leave,
                                       program.options) if done or program.leave else None

    def may_tell(self, program) -> bool:
        return bool(program.done) and not self._told

    def tell_servers(self, runner, program) -> None:
        _end(runner.session, program.done)
        self._told = True
        self.bind(runner, program)

    def __call__(self) -> None:
        if self._final is not None:
            self._final()


def _end(session, ops, leave=None, options=None) -> None:
    """`leave` (ops of `leave_ops`) within `options`' timeout, then `ops`
    (`done_ops`); servers that are gone already are no error. A process
    ending by an exception does not wait for the others (the job fails)."""
    import sys

    import tensorflow as tf
    if leave and getattr(sys, "last_value", None) is None:
        try:
            session.run(leave[:-1], options=options)
            session.run(leave[-1], options=options)
        except (tf.errors.OpError, RuntimeError) as e:
            print(f"parallax_ng: this worker ends without every other worker having reached "
                  f"its end ({type(e).__name__}); they may not read its parts of tables",
                  file=sys.stderr, flush=True)
    if ops:
        try:
            session.run(ops, options=tf.compat.v1.RunOptions(timeout_in_ms=10000))
        except (tf.errors.OpError, RuntimeError):
            pass


def tell_done(info: ClusterInfo, server) -> None:
    """Tell every server of the job that this worker is done (in a graph of
    its own; a Runner does it with `done_ops` in its graph when it closes)."""
    import tensorflow as tf
    graph = tf.Graph()
    ops = done_ops(graph, info.server_devices(), len(info.workers), info.task)
    with tf.compat.v1.Session(server.target, graph=graph,
                              config=info.session_config()) as session:
        session.run(ops)


def serve(info: ClusterInfo, timeout_seconds: float, poll_seconds: float = 2.0) -> int:
    """Run this server task until every worker has said it is done (0), or
    until no worker has been reachable for `timeout_seconds` (1). The
    server waits for the workers' tokens in one run that is never
    cancelled (a run given up every poll makes TensorFlow log four lines
    each time); a thread checks every `poll_seconds` that some worker is
    still reachable."""
    import signal
    import sys
    import threading
    import time

    import tensorflow as tf

    from . import heartbeat
    heartbeat.set_timeout(timeout_seconds)
    if threading.current_thread() is threading.main_thread():   # a preemption's notice:
        signal.signal(signal.SIGTERM,                           # serve while workers save
                      lambda signum, frame: heartbeat.tell("stopping", "SIGTERM"))
    server = info.start_server()
    graph = tf.Graph()
    with graph.as_default(), tf.device(f"/job:ps/replica:0/task:{info.task}/device:CPU:0"):
        queue = tf.queue.FIFOQueue(len(info.workers), [tf.int32], shapes=[[]],
                                   shared_name=DONE_QUEUE)
        take = queue.dequeue()
    config = info.session_config()
    config.device_filters.append(f"/job:ps/task:{info.task}")   # look for no other task

    def watch():
        seen = time.monotonic()
        while True:
            time.sleep(poll_seconds)
            if any(_reachable(address) for address in info.workers):
                seen = time.monotonic()
            elif time.monotonic() - seen > timeout_seconds:
                print(f"parallax_ng: ps {info.task}: no worker has been reachable for "
                      f"{timeout_seconds:g} s; stopping", file=sys.stderr, flush=True)
                os._exit(1)     # the waiting run cannot be given up without a log line

    def wait():
        done = set()
        with tf.compat.v1.Session(server.target, graph=graph, config=config) as session:
            while len(done) < len(info.workers):    # a worker may say it twice (two runners)
                done.add(int(session.run(take)))

    threading.Thread(target=watch, daemon=True).start()
    waiting = threading.Thread(target=wait, daemon=True)
    waiting.start()
    while waiting.is_alive():      # the main thread stays free for a SIGTERM's handler
        waiting.join(0.5)
    linger = time.monotonic() + LINGER_SECONDS     # while the workers close their sessions
    while time.monotonic() < linger and any(_reachable(a) for a in info.workers):
        time.sleep(0.2)
    return 0


def serve_task(info: ClusterInfo, timeout_seconds: float) -> None:
    """A parameter-server task whose process runs the training script (as
    orchestrators that set TF_CONFIG start every task): serve until the
    workers are done, then end the process with `serve`'s code, as
    tf.distribute.Server.join() never returns to the script. (Tasks that
    `parallax-ng run` starts run `serve` alone, not the script.)"""
    import sys
    code = serve(info, timeout_seconds)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _reachable(address: str) -> bool:
    import socket
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=1.0):
            return True
    except OSError:
        return False


SHARE_QUEUE = "parallax_ng/from_worker_0"   # on server 0: one element per other worker


def share(info: ClusterInfo, server, value, timeout_seconds: float):
    """Worker 0's `value` (JSON-able), given once to every other worker
    through a queue on server 0 (without servers: on worker 0): worker 0
    passes it and gets it back once every other worker has it (each answers
    on a second queue, so worker 0 may end its process then), the others
    pass None and get it. DeadlineExceededError when that takes longer than
    the timeout."""
    import tensorflow as tf
    graph = tf.Graph()
    where = (info.server_devices() or ["/job:worker/replica:0/task:0/device:CPU:0"])[0]
    others = len(info.workers) - 1
    with graph.as_default(), tf.device(where), \
            tf.compat.v1.name_scope("parallax/share/"):
        queue = tf.queue.FIFOQueue(len(info.workers), [tf.string], shapes=[[]],
                                   shared_name=SHARE_QUEUE)
        acks = tf.queue.FIFOQueue(len(info.workers), [tf.int32], shapes=[[]],
                                  shared_name=SHARE_QUEUE + "/got")
        if info.task == 0:
            ops = [queue.enqueue_many([[json.dumps(value)] * others]),
                   acks.dequeue_many(others)]
        else:
            ops = [queue.dequeue(), acks.enqueue(info.task)]
    options = tf.compat.v1.RunOptions(timeout_in_ms=int(timeout_seconds * 1000))
    with tf.compat.v1.Session(server.target, graph=graph,
                              config=info.session_config()) as session:
        got = [session.run(op, options=options) for op in ops][0]
    return value if info.task == 0 else json.loads(got.decode())


def same_batches(info: ClusterInfo, server, batch: dict, timeout_seconds: float) -> None:
    """A TF2 step's first global batch (placeholder name -> value) against
    worker 0's, through `share` (`compare_batches` says what differs)."""
    mine = {name: _digest(value) for name, value in sorted(batch.items())}
    compare_batches(share(info, server, mine, timeout_seconds), mine, info.task)


def compare_batches(first: dict, mine: dict, worker: int) -> None:
    """Every worker must be called with the same global batch, of which it
    takes its own replicas' rows: against worker 0's batch (`first`,
    digests by placeholder), other shapes are a ConfigError, other values
    a warning (each worker trains its rows of a batch of its own)."""
    import re
    import warnings

    from ..errors import ConfigError

    def leaf(name):
        found = re.fullmatch(r"parallax_input_(\d+)(/\w+)?:0", name)
        return f"argument leaf {found.group(1)}" if found else name
    if worker == 0 or first == mine:
        return
    shapes = [f"{leaf(n)}: {mine.get(n, [None])[0]} against {first.get(n, [None])[0]}"
              for n in sorted(set(first) | set(mine)) if first.get(n, [None])[0] is None
              or mine.get(n, [None])[0] != first[n][0]]
    if shapes:
        raise ConfigError(
            f"worker {worker} was called with a batch of other shapes than worker 0's "
            f"({'; '.join(shapes)}): "
            "in a job every worker calls the step with the same global batch and takes its "
            "own replicas' rows of it. A dataset sharded per worker (as scripts for "
            "MultiWorkerMirroredStrategy shard it) gives each worker a part instead: give "
            "every worker the whole dataset (or pn.shard it, which splits it by replica)")
    differ = sorted({leaf(n) for n in mine if first.get(n) != mine[n]})
    warnings.warn(
        f"worker {worker}'s first batch differs from worker 0's ({', '.join(differ)}): "
        "each worker takes its own replicas' rows of the batch it is given, so the job "
        "trains on parts of different batches, not on one global batch as one device "
        "would. Where the data is shuffled without a seed (Keras fit's default "
        "shuffle=True, a dataset's shuffle), seed it alike on every worker "
        "(keras.utils.set_random_seed or tf.random.set_seed before the data is made) or "
        "pass shuffle=False; where it is sharded per worker, give every worker the whole "
        "dataset (or pn.shard it). Random augmentation in the input makes batches differ "
        "too, which is harmless", stacklevel=5)


def _digest(value) -> list:
    """[shape, dtype, sha1 of the bytes] of one fed value."""
    import hashlib

    import numpy as np
    array = np.asarray(value)
    data = array.astype(str).tobytes() if array.dtype == object else \
        np.ascontiguousarray(array).tobytes()
    return [list(array.shape), str(array.dtype), hashlib.sha1(data).hexdigest()]
