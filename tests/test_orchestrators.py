"""docs/orchestrators.md: the Kubernetes manifest and the Slurm script give
every task the TF_CONFIG that puts it where `parallax-ng run` puts it
(`parallax-ng tf-config`, parallax_ng/cluster.py reading it). The Slurm
script runs with stand-ins for scontrol, srun and python; each pod's command
runs with a stand-in for python."""
import json
import os
import re
import subprocess
import sys

import pytest
import yaml
from task_env import TASK_PATH

from parallax_ng.cluster import ClusterInfo, from_env, tf_config
from parallax_ng.errors import ResourceError
from parallax_ng.resources import load_resources
from parallax_ng.tools.launch import plan_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "orchestrators.md")


def block(kind: str) -> str:
    with open(DOC) as f:
        found = re.findall(rf"```{kind}\n(.*?)```", f.read(), re.S)
    assert len(found) == 1, kind
    return found[0]


def launcher_places(resources) -> dict:
    """The ClusterInfo of every task as `parallax-ng run` starts it."""
    workers, ps = plan_cluster(resources)
    places = {("worker", i): ClusterInfo(tuple(workers), tuple(ps), "worker", i, h.devices)
              for i, h in enumerate(resources.hosts)}
    places.update({("ps", j): ClusterInfo(tuple(workers), tuple(ps), "ps", j, (("CPU", 0),))
                   for j in range(len(ps))})
    return places


def place_of(raw: str, resources, monkeypatch) -> ClusterInfo:
    monkeypatch.delenv("PARALLAX_NG_CLUSTER", raising=False)
    monkeypatch.setenv("TF_CONFIG", raw)
    return from_env(resources)


def stand_ins(tmp_path, **scripts) -> dict:
    """An environment whose PATH finds these scripts first (then this
    Python's own bin directory, for `parallax-ng`)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in scripts.items():
        path = bin_dir / name
        path.write_text("#!/bin/bash\n" + text)
        path.chmod(0o755)
    return dict(os.environ, PATH=f"{bin_dir}:{os.path.dirname(sys.executable)}:"
                f"{os.environ['PATH']}", PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2")


# the training script's stand-in: writes the TF_CONFIG it was given
PYTHON = 'echo "$TF_CONFIG" > "$OUT/$TASK_NAME"\n'


def test_each_kubernetes_pod_gets_the_launchers_place(tmp_path, monkeypatch):
    configmap, jobset = yaml.safe_load_all(block("yaml"))
    name = jobset["metadata"]["name"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] >= 1   # every pod restarts together
    res = tmp_path / "resources.yaml"
    res.write_text(configmap["data"]["resources.yaml"])
    resources = load_resources(str(res))
    config = yaml.safe_load(configmap["data"]["config.yaml"])
    assert config["checkpoint"]["dir"].startswith("/ckpt/")
    env = stand_ins(tmp_path, python=PYTHON)
    out = tmp_path / "out"
    out.mkdir()
    places = launcher_places(resources)
    jobs = {j["name"]: j["template"]["spec"] for j in jobset["spec"]["replicatedJobs"]}
    assert set(jobs) == {"worker", "ps"}
    for kind, spec in jobs.items():
        pod = spec["template"]["spec"]
        assert spec["completionMode"] == "Indexed" and pod["restartPolicy"] == "Never"
        assert spec["completions"] == sum(k == kind for k, _ in places)
        grace = {e["name"]: e["value"] for e in pod["containers"][0]["env"]}.get(
            "PARALLAX_NG_GRACE_SECONDS", "30")
        assert pod["terminationGracePeriodSeconds"] > float(grace)
        shell, flag, command = pod["containers"][0]["command"]
        assert (shell, flag) == ("sh", "-c")
        command = command.replace("/etc/parallax/resources.yaml", str(res))
        for index in range(spec["completions"]):
            address = (resources.hosts[index].address if kind == "worker"
                       else resources.ps[index])
            assert address == f"{name}-{kind}-0-{index}.{name}:2222"   # JobSet's pod names
            task = f"{kind}-{index}"
            done = subprocess.run(["sh", "-c", command], env=dict(
                env, JOB_COMPLETION_INDEX=str(index), OUT=str(out), TASK_NAME=task),
                capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
            raw = (out / task).read_text()
            assert place_of(raw, resources, monkeypatch) == places[(kind, index)]


SRUN = """while [ "$1" != bash ]; do shift; done
for i in 0 1 2; do SLURM_PROCID=$i TASK_NAME=task-$i "$@" || exit 1; done
"""


def test_the_slurm_script_gives_every_task_the_launchers_place(tmp_path, monkeypatch):
    script = tmp_path / "job.sbatch"
    script.write_text(block("bash"))
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0
    env = stand_ins(tmp_path, python=PYTHON, srun=SRUN,
                    scontrol='printf "node-a\\nnode-b\\nnode-c\\n"\n')
    out = tmp_path / "out"
    out.mkdir()
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                          env=dict(env, SHARED=str(tmp_path / "shared"), OUT=str(out),
                                   SLURM_JOB_NAME="lm", SLURM_JOB_NODELIST="node-[a-c]"))
    assert done.returncode == 0, done.stderr
    run = tmp_path / "shared" / "jobs" / "lm"
    resources = load_resources(str(run / "resources.yaml"))
    assert [h.address for h in resources.hosts] == ["node-b:2222", "node-c:2222"]
    assert resources.ps == ("node-a:2222",)
    config = yaml.safe_load((run / "config.yaml").read_text())
    assert config["checkpoint"]["dir"] == str(run / "checkpoints")
    places = launcher_places(resources)
    tasks = [("ps", 0), ("worker", 0), ("worker", 1)]        # SLURM_PROCID 0, 1, 2
    for procid, task in enumerate(tasks):
        raw = (out / f"task-{procid}").read_text()
        assert place_of(raw, resources, monkeypatch) == places[task]


def test_tf_config_needs_ports_and_a_task_of_the_job(tmp_path):
    res = tmp_path / "r.yaml"
    host = "\n    devices: [cpu:0]\n"
    res.write_text(f"hosts:\n  - address: 10.0.0.1:2222{host}  - address: 10.0.0.2{host}")
    with pytest.raises(ResourceError, match="'10.0.0.2' has no port"):
        tf_config(load_resources(str(res)), "worker:0")
    with pytest.raises(ResourceError, match=r"worker:I \(I < 2\) or ps:J \(J < 0\).*'ps:0'"):
        tf_config(load_resources(str(res)), "ps:0")
    res.write_text(f"hosts:\n  - address: 10.0.0.1:2222{host}")
    assert json.loads(json.dumps(tf_config(load_resources(str(res)), "worker:0"))) == {
        "cluster": {"worker": ["10.0.0.1:2222"]}, "task": {"type": "worker", "index": 0}}
