"""Cluster mode: which process this is in a multi-process job.

Requires: the launcher's PARALLAX_NG_CLUSTER variable (JSON), or TF_CONFIG as
Kubernetes operators and other orchestrators set it (then each worker's
devices come from the resource file's hosts, default one CPU).
Guarantees: the cluster spec, this task's type and index, its devices as
TensorFlow device names, the session config every process of the job must
share (collective group leader = worker 0), and the process's gRPC server.
What the servers of a job do, and how its workers share worker 0's
measurements: parallax_ng/runtime/serving.py.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import ConfigError, ResourceError
from .resources import session_config

ENV = "PARALLAX_NG_CLUSTER"
CONFIG_ENV = "PARALLAX_NG_CONFIG"
CHECKPOINT_ENV = "PARALLAX_NG_CHECKPOINT_DIR"   # `parallax-ng run --restarts`: checkpoint.dir's default
PROFILE_ENV = "PARALLAX_NG_PROFILE"    # `parallax-ng profile` of a job: "STEPS:0|1:PATH"


_STARTED: set = set()     # (task type, index) whose server this process started


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
        if (self.task_type, self.task) in _STARTED:
            raise ConfigError(
                f"{self.task_type} {self.task} of this job already runs a step: its first "
                "pn.parallelize model, pn.function or get_runner started the task's server, "
                "and a job's tasks serve that one step's graph, so another model or step "
                "cannot join the job. Train both in one step (one pn.function that trains "
                "both models), or the second in a job of its own that loads the first one's "
                "saved weights")
        try:
            server = tf.distribute.Server(self.spec, job_name=self.task_type,
                                          task_index=self.task, config=self.session_config(),
                                          start=True)
        except tf.errors.UnknownError as e:     # "Could not start gRPC server"
            address = (self.ps if self.task_type == "ps" else self.workers)[self.task]
            raise ResourceError(
                f"{self.task_type} {self.task} could not start its server at {address} "
                f"({e.message.strip()}): another process holds the port, or the address "
                "is not this machine's") from None
        _STARTED.add((self.task_type, self.task))
        return server

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


def tf_config(resources, task: str) -> dict:
    """The TF_CONFIG of task `task` ("worker:I" or "ps:J") of the job a
    resource file describes, for an orchestrator that starts each task
    itself (Kubernetes, Slurm): the process joins the same cluster, in the
    same place, as under `parallax-ng run` (`from_env` reads it). Every address needs its port (no free one can be picked for
    another machine, nor agreed on by separate calls)."""
    kind, _, index = task.partition(":")
    count = {"worker": len(resources.hosts), "ps": len(resources.ps)}
    if kind not in count or not index.isdigit() or int(index) >= count[kind]:
        raise ResourceError(f"--task must be worker:I (I < {count['worker']}) or ps:J "
                            f"(J < {count['ps']}) for this resource file, not {task!r}")
    workers, ps = [h.address for h in resources.hosts], list(resources.ps)
    for address in workers + ps:
        host, sep, port = address.rpartition(":")
        if not (sep and port.isdigit()):
            raise ResourceError(f"address {address!r} has no port: an orchestrator's tasks "
                                "need every address as host:port")
    cluster = {"worker": workers, **({"ps": ps} if ps else {})}
    return {"cluster": cluster, "task": {"type": kind, "index": int(index)}}
