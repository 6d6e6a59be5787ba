"""The timeline (parallax_ng/runtime/timeline.py): a Chrome trace of the
traced steps, in-process and merged over a job's tasks, and its summary."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng.runtime import timeline
from parallax_ng.tools import cli
from task_env import TASK_PATH

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check_trace(data: dict, tasks: set, steps: int) -> list:
    """Every event named, timed within its step's span on its worker (a
    server's within the span of the worker whose step ran it); every
    communication event with its bytes and what it carries."""
    events = timeline.named_events(data)
    spans = {(e["pid"], e["args"]["step"]): (e["ts"], e["ts"] + e["dur"])
             for e in events if e["cat"] == "step"}
    assert {p for p, _ in spans} == {t for t in tasks if t.startswith("worker")}
    assert len(spans) == steps * len({p for p, _ in spans})
    assert {e["pid"] for e in events} == tasks
    ops = [e for e in events if e["cat"] in ("compute", "communication")]
    for e in ops:
        owner = e["pid"] if e["pid"].startswith("worker") else \
            e["tid"].split("(")[1].split("'")[0]
        start, end = spans[(owner, e["args"]["step"])]
        assert start - 1e3 <= e["ts"] and e["ts"] + e["dur"] <= end + 1e3, e   # 1 ms slack
    talk = [e for e in ops if e["cat"] == "communication"]
    assert talk and all(isinstance(e["args"]["bytes"], int) and e["args"]["carries"]
                        for e in talk)
    assert {e["args"]["phase"] for e in ops if e["cat"] == "compute"} >= {"forward",
                                                                           "backward"}
    return events


def test_in_process_steps_traced_after_the_skipped_ones(tmp_path, capsys):
    """config `timeline: FILE` (3 steps after 2): the all-reduces of 2
    replicas with their bytes; the untraced steps run as before; the
    summary splits each step into compute, exposed communication, idle."""
    path = str(tmp_path / "t.json")
    g, h = embedding_regression(4, "adam")
    config = {"run_option": "allreduce", "timeline": {"file": path, "steps": 3, "skip": 2}}
    with pn.get_runner(g, local(2), config) as runner:
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(7):
            runner.run(h["train"])
    data = json.load(open(path))
    events = check_trace(data, {"worker 0"}, 3)
    assert sorted({e["args"]["step"] for e in events}) == [2, 3, 4]
    reduced = [e for e in events if e["args"].get("op") == "CollectiveReduce"]
    assert reduced and all(e["args"]["bytes"] > 0 for e in reduced)
    shares = timeline.summary(data)
    assert len(shares) == 3
    for s in shares:
        assert s.compute > 0 and s.exposed >= 0 and s.idle >= 0
        assert s.compute + s.exposed + s.idle == pytest.approx(s.seconds, rel=1e-6)
    assert cli.main(["timeline", path, "--png", str(tmp_path / "t.png")]) == 0
    out = capsys.readouterr().out
    assert "worker 0" in out and "bucket_0 reduce" in out      # the dense variables
    assert (tmp_path / "t.png").stat().st_size > 1000


def test_a_job_s_timeline_merges_every_task(tmp_path):
    """`parallax-ng run --timeline` of lm_small, 2 workers + 1 server
    (fusion buffers, sparse rows on the server): one trace with both
    workers and the server, its fusion-buffer shards and pushed rows with
    their bytes and the link model's prediction; the parts are gone."""
    res = os.path.join(ROOT, "configs", "resources_2workers_1ps.yaml")   # as docs/tools.md
    config = tmp_path / "c.yaml"
    config.write_text("run_option: hybrid\ndense_method: bfb\nsparse_method: ps\n"
                      "timeline: {steps: 4, skip: 3}\n")
    path = str(tmp_path / "job.json")
    done = subprocess.run(
        [sys.executable, "-m", "parallax_ng", "run", os.path.join(ROOT, "examples",
                                                                  "lm_small.py"),
         "-r", res, "--timeline", path, "--", "--steps", "10", "--vocab", "2000",
         "--words", "20000", "--batch", "16", "--config", str(config)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=TASK_PATH, TF_CPP_MIN_LOG_LEVEL="2"))
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert f"timeline of the job in {path}" in done.stderr
    assert not [p for p in os.listdir(tmp_path) if ".worker-" in p]
    data = json.load(open(path))
    events = check_trace(data, {"worker 0", "worker 1", "ps 0"}, 4)
    carried = timeline.received(data)
    assert any(k.startswith("bfb buffer_") and v > 0 for k, v in carried.items()), carried
    assert any(k.startswith("server_sync ") and v > 0 for k, v in carried.items()), carried
    predicted = [e["args"]["predicted_ms"] for e in events
                 if "predicted_ms" in e.get("args", {})]
    assert predicted and np.all(np.array(predicted) >= 0)


def test_summary_of_hand_made_events():
    """compute 0-4 ms and 6-8 ms, communication 3-7 ms, step 0-10 ms:
    compute 6, exposed 2 (4-6), idle 2 (8-10)."""
    events = [{"name": "step 0", "ph": "X", "cat": "step", "pid": "worker 0",
               "tid": "steps", "ts": 0.0, "dur": 10e3, "args": {"step": 0}}]
    for cat, a, b in (("compute", 0, 4), ("compute", 6, 8), ("communication", 3, 7)):
        events.append({"name": cat, "ph": "X", "cat": cat, "pid": "worker 0",
                       "tid": "CPU:0", "ts": a * 1e3, "dur": (b - a) * 1e3,
                       "args": {"step": 0, "op": "X", "bytes": 1, "carries": "x"}})
    (share,) = timeline.summary(timeline.trace(events))
    assert (share.compute, share.exposed, share.idle) == pytest.approx((6e-3, 2e-3, 2e-3))
    assert timeline.task_of("/job:ps/replica:0/task:1/device:CPU:0") == ("ps 1", "CPU:0")
    assert timeline.task_of("/job:localhost/replica:0/task:0/device:CPU:1") == \
        ("worker 0", "CPU:1")


def test_timeline_config_errors():
    assert pn.load_config({"timeline": "t.json"}).timeline.file == "t.json"
    with pytest.raises(pn.ConfigError, match="timeline.steps"):
        pn.load_config({"timeline": {"file": "t.json", "steps": -1}})
