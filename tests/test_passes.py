import os
from dataclasses import dataclass

import pytest

import transforms
from parallax_ng.errors import GraphError
from passkit import context


@dataclass(frozen=True)
class DanglingPass:
    """Breaks the graph on purpose: an input that names nothing."""
    name: str = "dangling"

    def run(self, ir, ctx):
        broken = type(ir.nodes[0])()
        broken.CopyFrom(ir.nodes[0])
        broken.input.append("no_such_node")
        return ir.replace({broken.name: broken}), {}


def test_manager_runs_the_default_pipeline_and_records_each_pass(tmp_path):
    from parallax_ng.passes import PassManager
    ctx = context(n=2, optimizer="adam")
    manager = PassManager(transforms.default_pipeline(), dump_dir=str(tmp_path))
    out = manager.run(ctx.tg.ir, ctx)
    names = [r.name for r in manager.records]
    assert names == ["replicate", "shard_inputs", "aggregate", "state_sync", "place", "init",
                     "server_sync", "split_rows", "stage"]   # these act in multi-worker jobs only
    assert all(r.seconds >= 0 for r in manager.records)
    assert manager.records[-1].nodes == len(out)
    dumps = sorted(os.listdir(tmp_path))
    assert dumps[0] == "00_input.pb" and "06_init.pb" in dumps and "passes.json" in dumps
    assert "replicate" in manager.summary()


def test_failing_verification_names_the_pass_and_those_before():
    from parallax_ng.passes import PassManager
    ctx = context(n=2)
    manager = PassManager([transforms.ReplicatePass(), DanglingPass()])
    with pytest.raises(GraphError) as err:
        manager.run(ctx.tg.ir, ctx)
    text = str(err.value)
    assert "'dangling'" in text and "replicate" in text and "no_such_node" in text


def test_import_verification_runs_tensorflow():
    from parallax_ng.passes import PassManager
    ctx = context(n=2)
    manager = PassManager(transforms.default_pipeline(), verify="import")
    assert len(manager.run(ctx.tg.ir, ctx)) > len(ctx.tg.ir)
