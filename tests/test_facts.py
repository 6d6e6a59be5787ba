"""Facts: the analyses the planner and the passes share, each made once per
variable, a refusal remembered; one Facts per build, on the pass context."""
import pytest

import parallax_ng as pn
from models import embedding_regression, local
from parallax_ng import build
from parallax_ng.errors import ConfigError
from parallax_ng.graph import frontend
from parallax_ng.planning import column_cut
from parallax_ng.planning.facts import Facts
from parallax_ng.resources import load_resources


def test_each_fact_is_made_once_and_a_refusal_is_remembered(monkeypatch):
    tg = frontend.load(embedding_regression(4, "adam")[0])
    calls = []
    real = column_cut.uses
    monkeypatch.setattr(column_cut, "uses", lambda tg, var: calls.append(var) or real(tg, var))
    facts = Facts(tg)
    assert facts.column_uses("emb") is facts.column_uses("emb")
    assert facts.deferral("emb").var == "emb"       # asks column_uses again: made once
    for _ in range(2):
        with pytest.raises(ConfigError, match="dense"):
            facts.column_uses("dense/w")
    assert calls == ["emb", "dense/w"]


def test_the_planner_and_the_passes_share_the_build_s_facts(monkeypatch):
    g, _ = embedding_regression(4, "adam")
    config = pn.load_config({"run_option": "allreduce", "sparse_method": "alltoall"})
    calls = []
    real = column_cut.uses
    monkeypatch.setattr(column_cut, "uses", lambda tg, var: calls.append(var) or real(tg, var))
    b = build.Build(frontend.load(g), build.make(config, load_resources(local(2))))
    plan = b.plan()
    _, ctx, _ = b.rewrite(plan)
    assert plan.variables["emb"].method == "alltoall"
    assert ctx.facts is b.facts and calls == ["emb"]     # asked by planner and passes
