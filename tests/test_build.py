"""The build: the job resolved once, the analysis made once, one plan when
nothing is measured, and its refusals before anything starts."""
import json

import pytest

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng import build
from parallax_ng.cluster import CONFIG_ENV, ClusterInfo
from parallax_ng.errors import ConfigError, ResourceError
from parallax_ng.graph import frontend
from parallax_ng.planning import analysis


def test_a_jobs_config_and_an_explicit_one_must_agree(tmp_path, monkeypatch):
    path = tmp_path / "job.yaml"
    path.write_text("run_option: ps\n")
    monkeypatch.setenv(CONFIG_ENV, str(path))
    with pytest.raises(ConfigError, match="differs from the job's .*-c .*job.yaml"):
        pn.get_runner("unused.meta", None, {"run_option": "hybrid"})
    assert build.job_config(None).run_option == "ps"                       # the job's
    assert build.job_config({"run_option": "ps"}).run_option == "ps"       # the same: fine
    monkeypatch.delenv(CONFIG_ENV)
    assert build.job_config({"run_option": "hybrid"}).run_option == "hybrid"


def test_the_job_is_this_machine_a_planned_job_or_a_worker_of_one():
    two_hosts = {"hosts": [{"address": "10.0.0.1", "devices": ["cpu:0"]},
                           {"address": "10.0.0.2", "devices": ["cpu:0"]}]}
    assert build.resolve(local(2)).cluster is None and build.resolve(local(2)).workers == 1
    planned = build.resolve(two_hosts, planned=True)
    assert planned.cluster.task == 0 and planned.workers == 2 and planned.resources is None
    with pytest.raises(ResourceError, match="lists 2 hosts; get_runner runs on one"):
        build.resolve(two_hosts)           # not started as a job
    info = ClusterInfo(("127.0.0.1:1", "127.0.0.1:2"), (), "worker", 1, (("CPU", 0),))
    assert build.make(pn.load_config({}), None, info).workers == 2


def test_the_analysis_is_made_once_and_an_unmeasured_plan_once(monkeypatch):
    calls = []
    real = analysis.analyze
    monkeypatch.setattr(analysis, "analyze", lambda tg: calls.append(1) or real(tg))
    g, _ = embedding_regression(4, "adam")
    b = build.Build(frontend.load(g), build.resolve(local(2), {"run_option": "hybrid"}))
    first = b.plan()
    assert b.plan() is first and len(calls) == 1
    b.share(None)                     # what a job's worker 0 measured: planned again
    assert b.plan() is not first and b.plan().decisions() == first.decisions()
    assert len(calls) == 1


def test_a_profile_file_is_read_once_when_the_job_is_resolved(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"forward_time": 0.0, "layers": [
        {"name": "dense/w", "bytes": 64, "backward_time": 0.1}],
        "allreduce": {"a": 1.0, "b": 0.0}}))
    job = build.resolve(local(2), {"run_option": "allreduce",
                                   "buckets": {"profile": str(path)}})
    path.unlink()                     # planning reads the profile the job holds
    assert job.bucket_profile.allreduce.a == 1.0
    g, _ = embedding_regression(4, "adam")
    assert len(build.Build(frontend.load(g), job).plan().buckets) == 1
