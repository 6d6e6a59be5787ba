"""Queue-based input: TF1 input producers, readers and batchers, filled by
queue runners that the runner starts for every replica."""
import time

import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from models import local, read_name
from parallax_ng.errors import GraphError

tf1 = tf.compat.v1
STEPS, BATCH, T = 8, 2, 3


def producer_model(data, shuffle=False, num_epochs=None, seed=4):
    """Step i reads batch `data[i]` ([batch, T] ids) from a range producer, as
    the PTB reader does; Adam on an embedding and a dense weight."""
    g = tf.Graph()
    with g.as_default():
        i = tf.identity(tf1.train.range_input_producer(
            len(data), shuffle=shuffle, seed=seed, num_epochs=num_epochs).dequeue(), "i")
        x = tf.gather(tf.constant(data), i)
        emb = tf1.get_variable("emb", initializer=np.linspace(-1, 1, 40, dtype=np.float32)
                               .reshape(10, 4))
        w = tf1.get_variable("w", initializer=np.ones([4, 1], np.float32))
        pred = tf.matmul(tf.reduce_mean(tf1.nn.embedding_lookup(emb, x), 1), w)
        loss = tf.reduce_mean(tf.square(pred - 1.0), name="loss")
        tf1.train.AdamOptimizer(0.05).minimize(loss, name="train")
        tf1.group(tf1.global_variables_initializer(), tf1.local_variables_initializer(),
                  name="init_all")
    return g


def train_single(graph, steps):
    with tf1.Session(graph=graph) as sess:
        sess.run("init_all")
        coord = tf.train.Coordinator()
        threads = tf1.train.start_queue_runners(sess, coord)
        for _ in range(steps):
            sess.run("train")
        coord.request_stop()
        coord.join(threads)
        return sess.run([read_name(v, graph) for v in ("emb", "w")])


@pytest.mark.parametrize("n", [2, 3])
def test_producer_elements_are_dealt_out_and_training_equals_one_device(n, capsys):
    rng = np.random.RandomState(0)
    per_replica = rng.randint(0, 10, size=(STEPS * n, BATCH, T)).astype(np.int32)
    # one device with batch n*BATCH: step s reads what replicas 0..n-1 read at step s
    single = np.stack([np.concatenate(per_replica[s * n:(s + 1) * n]) for s in range(STEPS)])
    g = producer_model(per_replica)
    with pn.get_runner(g, local(n)) as runner:
        assert set(runner.plan.split_queues) == {"input_producer"}
        runner.run("init_all")
        seen = [runner.run(["train", "i:0"], per_replica=True)[1] for _ in range(STEPS)]
        got = runner.run([read_name(v, g) for v in ("emb", "w")], per_replica=True)
    for r in range(n):                       # replica r reads r, r+n, r+2n, ...
        assert [int(s[r]) for s in seen] == list(range(r, STEPS * n, n))
    want = train_single(producer_model(single), STEPS)
    for copies, value in zip(got, want):
        for c in copies:
            assert np.max(np.abs(c - value)) <= 1e-5
    assert "reads whole files" not in capsys.readouterr().err


def test_a_shuffled_producer_is_dealt_out_without_overlap():
    """The shuffle draws the same order on every replica (else the parts
    would overlap): each epoch, the replicas' parts are disjoint and whole."""
    data = np.zeros([12, BATCH, T], np.int32)
    with pn.get_runner(producer_model(data, shuffle=True), local(3)) as runner:
        assert set(runner.plan.random.values()) <= {"identical", "distinct"}
        assert runner.plan.random["input_producer/RandomShuffle"] == "identical"
        runner.run("init_all")
        for _ in range(2):     # two epochs
            epoch = [runner.run("i:0", per_replica=True) for _ in range(4)]
            assert sorted(int(v) for step in epoch for v in step) == list(range(12))
        assert epoch != [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]   # shuffled


def test_files_are_split_over_replicas_and_batched(tmp_path, capsys):
    """Each replica reads whole files of its own: every line once an epoch,
    but a step's rows are not one device's global batch (a regression read
    so was 0.55 apart after 6 steps), which the runner says in a line,
    naming the producer, the reader and the form that is exact."""
    files = []
    for f in range(4):
        path = tmp_path / f"part{f}.txt"
        path.write_text("".join(f"{f}{line}\n" for line in range(3)))
        files.append(str(path))
    g = tf.Graph()
    with g.as_default():
        names = tf1.train.string_input_producer(files, shuffle=False, num_epochs=1)
        _, line = tf1.TextLineReader().read(names)
        batch = tf.identity(tf1.train.batch([tf.strings.to_number(line)], 3), "batch")
        w = tf1.get_variable("w", [1])
        tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_sum(w * batch))
        init = tf1.group(tf1.global_variables_initializer(), tf1.local_variables_initializer())
    with pn.get_runner(g, local(2)) as runner:
        assert set(runner.plan.split_queues) == {"input_producer"}   # the file names
        runner.run(init)
        lines = [runner.run("batch:0", per_replica=True) for _ in range(2)]
        with pytest.raises(tf.errors.OutOfRangeError):     # one epoch, as one device
            runner.run("batch:0")
    replica = [sorted(int(v) for step in lines for v in step[r]) for r in range(2)]
    assert replica == [[0, 1, 2, 20, 21, 22], [10, 11, 12, 30, 31, 32]]
    said = [ln for ln in capsys.readouterr().err.splitlines() if "reads whole files" in ln]
    assert len(said) == 1 and said[0].startswith(
        "parallax_ng: queue 'input_producer' deals its names out to the replicas and "
        "'ReaderReadV2' reads whole files from it") and \
        "pn.shard(tf.data.TFRecordDataset(files))" in said[0], said


def test_a_queue_no_runner_fills_is_an_error_naming_it():
    g = tf.Graph()
    with g.as_default():
        q = tf1.FIFOQueue(4, [tf.float32], shapes=[[]], name="my_queue")
        x = q.dequeue()
        w = tf1.get_variable("w", [1])
        tf1.train.GradientDescentOptimizer(0.1).minimize(w * x)
    start = time.monotonic()
    with pytest.raises(GraphError, match="queue 'my_queue' is read by .* no QueueRunner.*"
                                         "pn.shard"):
        pn.get_runner(g, local(2))
    assert time.monotonic() - start < 30


def test_a_producer_filled_one_element_at_a_time_is_an_error():
    g = tf.Graph()
    with g.as_default():
        q = tf1.FIFOQueue(4, [tf.float32], shapes=[[]], name="one_by_one")
        tf1.train.add_queue_runner(tf1.train.QueueRunner(q, [q.enqueue(3.0)]))
        w = tf1.get_variable("w", [1])
        tf1.train.GradientDescentOptimizer(0.1).minimize(w * q.dequeue())
    with pytest.raises(GraphError, match="'one_by_one' is filled by .*one element at a time"):
        pn.get_runner(g, local(2))


def test_fewer_producer_elements_than_replicas_is_an_error():
    g = producer_model(np.zeros([2, BATCH, T], np.int32))
    with pytest.raises(GraphError, match="enqueues 2 elements at a time, fewer than the "
                                         "job's 3 replicas"):
        pn.get_runner(g, local(3))


def test_a_failing_queue_runner_raises_its_own_error_not_a_hang():
    """num_epochs keeps a local counter; without local_variables_initializer
    the runner fails, its queue closes, and the run raises that failure."""
    g = producer_model(np.zeros([4, BATCH, T], np.int32), num_epochs=1)
    with pn.get_runner(g, local(2)) as runner:
        runner.run(g.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)[0].initializer)
        start = time.monotonic()
        # resource variables say NotFound, reference variables FailedPrecondition
        with pytest.raises((tf.errors.NotFoundError, tf.errors.FailedPreconditionError),
                           match="epochs"):
            runner.run("i:0")
        assert time.monotonic() - start < 30


def test_runs_that_never_read_a_queue_start_no_runner():
    g = producer_model(np.zeros([4, BATCH, T], np.int32))
    with pn.get_runner(g, local(2)) as runner:
        runner.run("init_all")
        assert runner._queues._threads is None
        runner.run("i:0")
        assert len(runner._queues._threads) >= 2
