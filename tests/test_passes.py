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


def test_manager_runs_the_plans_pipeline_and_records_each_pass(tmp_path):
    from parallax_ng.pipeline.passes import PassManager
    ctx = context(n=2, optimizer="adam")
    manager = PassManager(transforms.pipeline_for(ctx.plan), dump_dir=str(tmp_path))
    out = manager.run(ctx.tg.ir, ctx)
    names = [r.name for r in manager.records]
    assert names == ["replicate", "shard_inputs", "aggregate", "state_sync", "selected_means",
                     "input_gradients", "place", "lookups_on_servers", "colocate_updates",
                     "loss_scales", "init", "orderings"]
    assert manager.records[0].report["replicas"] == 2
    assert manager.records[2].report == {"allreduce": 3, "ps": 1, "allgather": 0, "bfb": 0,
                                         "alltoall": 0, "factors": 0}
    assert manager.records[-1].nodes == len(out) > 1.5 * len(ctx.tg.ir)   # two replicas
    dumps = sorted(os.listdir(tmp_path))
    assert dumps[0] == "00_input.pb" and "11_init.pb" in dumps and "12_orderings.pb" in dumps and "passes.json" in dumps
    assert "replicate" in manager.summary()


def test_failing_verification_names_the_pass_and_those_before():
    from parallax_ng.pipeline.passes import PassManager
    ctx = context(n=2)
    manager = PassManager([transforms.ReplicatePass(), DanglingPass()])
    with pytest.raises(GraphError) as err:
        manager.run(ctx.tg.ir, ctx)
    text = str(err.value)
    assert "'dangling'" in text and "replicate" in text and "no_such_node" in text


@dataclass(frozen=True)
class BuggyPass:
    """A pass with a bug: a lookup of a node that is not there."""
    name: str = "buggy"

    def run(self, ir, ctx):
        return ir, {"found": {}["missing"]}


def test_any_error_a_pass_raises_names_the_pass_and_keeps_its_type():
    from parallax_ng.pipeline.passes import PassManager
    ctx = context(n=2)
    manager = PassManager([transforms.ReplicatePass(), BuggyPass()])
    with pytest.raises(KeyError) as err:
        manager.run(ctx.tg.ir, ctx)
    assert err.value.__notes__ == ["parallax_ng: raised in pass 'buggy' (after ['replicate'])"]


@dataclass(frozen=True)
class MistypedPass:
    """A graph whose structure is sound but which TensorFlow rejects: an op
    (AddN, ConcatV2) that claims more inputs than it has."""
    name: str = "mistyped"

    def run(self, ir, ctx):
        node = next(n for n in ir.nodes if "N" in n.attr)
        broken = type(node)()
        broken.CopyFrom(node)
        broken.attr["N"].i += 1
        return ir.replace({broken.name: broken}), {}


def test_import_verification_runs_tensorflow():
    from parallax_ng.pipeline.passes import PassManager
    ctx = context(n=2)
    passes = [transforms.ReplicatePass(), transforms.AggregatePass(), MistypedPass()]
    assert len(PassManager(passes, verify="full").run(ctx.tg.ir, ctx)) > len(ctx.tg.ir)
    with pytest.raises(GraphError, match="'mistyped'.*TensorFlow rejects the graph"):
        PassManager(passes, verify="import").run(ctx.tg.ir, ctx)
    assert len(PassManager(transforms.pipeline_for(ctx.plan), verify="import")
               .run(ctx.tg.ir, ctx)) > len(ctx.tg.ir)
