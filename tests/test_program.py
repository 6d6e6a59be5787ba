"""Programs: what the data-parallel passes and layer-to-layer execution give
the one Runner (the map of fetches, the executor, checkpoints, the barrier)."""
import numpy as np
import pytest
import tensorflow as tf
from models import embedding_regression, local, read_name
from passkit import cluster_transform
from test_l2l import LAYERS, stack

import parallax_ng as pn
from parallax_ng.config import load_config
from parallax_ng.pipeline.results import Barrier
from parallax_ng.runtime.checkpoint import Checkpointer
from parallax_ng.runtime.fetches import ReplicaFetchMap
from parallax_ng.runtime.program import run_options, transformed
from parallax_ng.runtime.runner import Runner

ONE = {"hosts": [{"address": "localhost", "devices": ["cpu:0", "cpu:1"]}]}


def test_the_passes_graph_as_a_program(tmp_path):
    g, h = embedding_regression(4, "adam")
    ir, ctx, manager = pn.transform(g, local(2), {"run_option": "hybrid"})
    config = load_config({"checkpoint": {"dir": str(tmp_path)}})
    program = transformed(ir, ctx, config, manager.records)
    assert isinstance(program.fetches, ReplicaFetchMap)
    assert program.ctx is ctx and program.plan is ctx.plan and program.tg is ctx.tg
    assert program.executor.barrier is None and program.done is None
    assert program.options.timeout_in_ms == int(ctx.plan.timeout_seconds * 1000)
    assert isinstance(program.checkpoints, Checkpointer)
    assert program.records == manager.records
    assert program.graph.get_operation_by_name(h["train"].name)
    assert transformed(ir, ctx, load_config({})).checkpoints is None


def test_a_job_worker_tells_its_servers_and_holds_a_barrier():
    g, _ = embedding_regression(4, "adam")
    ir, ctx = cluster_transform(g, worker=1, servers=1)
    program = transformed(ir, ctx, load_config({}), server=True)
    assert len(program.done) == 1 and not program.servers_idle
    assert program.executor.barrier.op(1) == "parallax/server_sync/wait"
    assert program.worker == 1


def test_a_job_worker_whose_table_parts_others_read_waits_for_their_ends():
    """A table's columns by alltoall live on the workers: worker 1's program
    ends only after every worker put its token in its queue (serving.leave_ops);
    with the table on the server, no worker waits for another."""
    g, _ = embedding_regression(4, "adam")
    ir, ctx = cluster_transform(g, worker=1, servers=0, run_option="allreduce",
                                variable_methods={"emb": "alltoall"})
    program = transformed(ir, ctx, load_config({}), server=True)
    *puts, take = program.leave
    assert [op.device for op in puts] == [f"/job:worker/replica:0/task:{k}/device:CPU:0"
                                          for k in range(2)]
    assert take.device == puts[1].device and take.op.type == "QueueDequeueManyV2"
    assert program.done is None
    ir, ctx = cluster_transform(embedding_regression(4, "adam")[0], worker=1, servers=1)
    assert transformed(ir, ctx, load_config({}), server=True).leave is None


def test_the_runner_reads_the_global_step_through_the_checkpointer(tmp_path):
    g, h = embedding_regression(4, "adam")
    ir, ctx, _ = pn.transform(g, local(2), {})
    config = load_config({"checkpoint": {"dir": str(tmp_path), "every_steps": 100}})
    from parallax_ng.resources import session_config
    with Runner(transformed(ir, ctx, config), config,
                session_config([("CPU", 0), ("CPU", 1)])) as runner:
        runner.run([h["init"], h["iterator_init"]])
        for _ in range(3):
            runner.run(h["train"])
        assert runner._global_step() == 3 == runner.run(read_name("global_step", g))
    assert tf.train.latest_checkpoint(str(tmp_path)).endswith("model.ckpt-3")   # at close


def test_layer_to_layer_runs_through_the_same_runner(tmp_path):
    g, h = stack(4)
    config = {"l2l": {"layers": LAYERS}, "checkpoint": {"dir": str(tmp_path)}}
    with pn.get_runner(g, ONE, config) as r:
        assert type(r) is Runner and r.ctx is None
        assert r.executor.barrier is None          # one process: no worker to sync
        assert r.program.checkpoints.step is not None
        assert r.program.options.timeout_in_ms == run_options(300).timeout_in_ms
        r.run(h["init"])
        with pytest.raises(pn.FetchError, match="per_replica"):
            r.run(h["loss"], per_replica=True)
        losses = [r.run([h["train"], h["loss"]])[1] for _ in range(2)]
        assert np.isfinite(losses).all()
    reader = tf.train.load_checkpoint(tf.train.latest_checkpoint(str(tmp_path)))
    assert "parallax/iterator/0/" in " ".join(reader.get_variable_to_shape_map())


def test_a_barrier_folded_into_training_runs_after_initializing_only():
    ex = Barrier("sync", "sync", folded=True)
    from parallax_ng.runtime.executor import Executor
    executor = Executor(tf.Graph(), barrier=ex, worker=1)
    assert executor.ends_with_barrier(initialized=True, trained=False)
    assert not executor.ends_with_barrier(initialized=False, trained=True)
