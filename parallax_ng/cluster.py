"""Cluster mode: which process this is in a multi-process job.

Requires: the launcher's PARALLAX_NG_CLUSTER variable (JSON), or TF_CONFIG as
Kubernetes operators and other orchestrators set it (then each worker's
devices come from the resource file's hosts, default one CPU).
Guarantees: the cluster spec, this task's type and index, its devices as
TensorFlow device names, the session config every process of the job must
share (collective group leader = worker 0), and the process's gRPC server.
A parameter-server task `serve`s until every worker has said it is done
(`done_ops`, which a worker's runner runs when it closes), or until no
worker has been reachable for the timeout.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import ResourceError
from .resources import session_config

ENV = "PARALLAX_NG_CLUSTER"
CONFIG_ENV = "PARALLAX_NG_CONFIG"
PROFILE_ENV = "PARALLAX_NG_PROFILE"    # `parallax-ng profile` of a job: "STEPS:0|1:PATH"
DONE_QUEUE = "parallax_ng/workers_done"   # on every server: one token per finished worker


@dataclass(frozen=True)
class ClusterInfo:
    workers: tuple[str, ...]                 # host:port of every worker
    ps: tuple[str, ...]                      # host:port of every parameter server
    task_type: str                           # "worker" or "ps"
    task: int
    devices: tuple[tuple[str, int], ...]     # this worker's devices

    @property
    def spec(self):
        """The tf.train.ClusterSpec of the job."""
        import tensorflow as tf
        jobs = {"worker": list(self.workers)}
        if self.ps:
            jobs["ps"] = list(self.ps)
        return tf.train.ClusterSpec(jobs)

    def device_strings(self) -> list[str]:
        return [f"/job:worker/replica:0/task:{self.task}/device:{kind}:{i}"
                for kind, i in self.devices]

    def server_devices(self) -> list[str]:
        return [f"/job:ps/replica:0/task:{j}/device:CPU:0" for j in range(len(self.ps))]

    @property
    def host(self) -> str:
        return f"/job:worker/replica:0/task:{self.task}/device:CPU:0"

    def session_config(self):
        return session_config(self.devices, "/job:worker/replica:0/task:0")

    def start_server(self):
        import tensorflow as tf
        try:
            return tf.distribute.Server(self.spec, job_name=self.task_type,
                                        task_index=self.task, config=self.session_config(),
                                        start=True)
        except tf.errors.UnknownError as e:     # "Could not start gRPC server"
            address = (self.ps if self.task_type == "ps" else self.workers)[self.task]
            raise ResourceError(
                f"{self.task_type} {self.task} could not start its server at {address} "
                f"({e.message.strip()}): another process holds the port, or the address "
                "is not this machine's") from None

    @classmethod
    def planned(cls, resources, worker: int = 0) -> "ClusterInfo":
        """Worker `worker` of the job a resource file describes, for planning
        only (addresses as given; nothing is started)."""
        return cls(tuple(h.address for h in resources.hosts), tuple(resources.ps), "worker",
                   worker, resources.hosts[worker].devices)

    def to_env(self) -> str:
        return json.dumps({"worker": list(self.workers), "ps": list(self.ps),
                           "task_type": self.task_type, "task": self.task,
                           "devices": [list(d) for d in self.devices]})


def from_env(resources=None) -> ClusterInfo | None:
    """This process's place in a job, or None when not started as part of one."""
    raw = os.environ.get(ENV)
    if raw:
        d = json.loads(raw)
        return ClusterInfo(tuple(d["worker"]), tuple(d.get("ps", ())), d["task_type"],
                           int(d["task"]), tuple((k, int(i)) for k, i in d["devices"]))
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        return None
    d = json.loads(raw)
    cluster, task = d.get("cluster", {}), d.get("task", {})
    chief = tuple(cluster.get("chief", ()))
    workers = chief + tuple(cluster.get("worker", ()))   # a chief is worker 0 here
    if not workers or task.get("type") not in ("worker", "ps", "chief"):
        raise ResourceError("TF_CONFIG needs cluster.worker (or chief) and task.type "
                            f"chief, worker or ps; got {raw[:200]}")
    index = int(task.get("index", 0))
    if task["type"] == "worker":
        index += len(chief)
    devices = (("CPU", 0),)
    if resources is not None and task["type"] != "ps" and index < len(resources.hosts):
        devices = resources.hosts[index].devices
    return ClusterInfo(workers, tuple(cluster.get("ps", ())),
                       "ps" if task["type"] == "ps" else "worker", index, devices)


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


def serve(info: ClusterInfo, timeout_seconds: float, poll_seconds: float = 2.0) -> int:
    """Run this server task until every worker has said it is done (0), or
    until no worker has been reachable for `timeout_seconds` (1). The
    server waits for the workers' tokens in one run that is never
    cancelled (a run given up every poll makes TensorFlow log four lines
    each time); a thread checks every `poll_seconds` that some worker is
    still reachable."""
    import sys
    import threading
    import time

    import tensorflow as tf

    from . import heartbeat
    heartbeat.set_timeout(timeout_seconds)
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

    done = set()
    threading.Thread(target=watch, daemon=True).start()
    with tf.compat.v1.Session(server.target, graph=graph, config=config) as session:
        while len(done) < len(info.workers):    # a worker may say it twice (two runners)
            done.add(int(session.run(take)))
    return 0


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
