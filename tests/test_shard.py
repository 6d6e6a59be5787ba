"""`pn.shard`: disjoint parts per replica, element and file-list datasets."""
import numpy as np
import pytest
import tensorflow as tf

import parallax_ng as pn
from parallax_ng.graph import data
from models import local

tf1 = tf.compat.v1


def reader_graph(make_dataset):
    """A graph that trains nothing interesting but exposes the batch read."""
    g = tf.Graph()
    with g.as_default():
        ds = make_dataset()
        it = tf1.data.make_initializable_iterator(ds)
        x = tf.identity(it.get_next(), name="x")
        w = tf1.get_variable("w", initializer=np.float32(1.0))
        loss = tf.reduce_mean(tf.cast(x, tf.float32) * w)
        tf1.train.GradientDescentOptimizer(0.0).minimize(loss, name="train")
        tf1.global_variables_initializer()
    return g, it.initializer.name


def test_element_dataset_replicas_read_disjoint_parts():
    g, init = reader_graph(lambda: pn.shard(tf.data.Dataset.range(24)).batch(3))
    with pn.get_runner(g, local(2)) as runner:
        runner.run(["init", init])
        per = [runner.run("x:0", per_replica=True) for _ in range(4)]
        with pytest.raises(tf.errors.OutOfRangeError):
            runner.run("x:0")
    seen = np.concatenate([np.concatenate(p) for p in per])
    assert sorted(seen.tolist()) == list(range(24))
    assert sorted(per[0][0].tolist()) == [0, 2, 4] and sorted(per[0][1].tolist()) == [1, 3, 5]


@pytest.mark.parametrize("how", ["batch", "batch-prefetch", "padded-batch"])
def test_a_batched_dataset_is_sharded_by_its_rows(how):
    """`pn.shard(ds.batch(3))` (the batches sharded, not the rows): each
    replica batches its own rows, so 22 rows on 2 replicas end in a step of
    2 + 2 rows, one device's last batch of 4 (sharding the batches gave
    replica 0 a last batch replica 1 had no partner for, and the step that
    read it ended the epoch: those rows went untrained)."""
    def make():
        rows = tf.data.Dataset.range(22)
        batched = {"batch": lambda: rows.batch(3),
                   "batch-prefetch": lambda: rows.batch(3).prefetch(2),
                   "padded-batch": lambda: rows.padded_batch(3, padded_shapes=[])}[how]()
        return pn.shard(batched)
    g, init = reader_graph(make)
    with pn.get_runner(g, local(2)) as runner:
        runner.run(["init", init])
        per = [runner.run("x:0", per_replica=True) for _ in range(4)]
        with pytest.raises(tf.errors.OutOfRangeError):
            runner.run("x:0")
    assert [sorted(np.concatenate(p).tolist()) for p in per] == [
        list(range(0, 6)), list(range(6, 12)), list(range(12, 18)), list(range(18, 22))]
    assert per[0][0].tolist() == [0, 2, 4] and per[3][1].tolist() == [19, 21]


@pytest.mark.parametrize("iterator", ["initializable", "one-shot"])
@pytest.mark.parametrize("how", ["rows", "batches", "files-then-rows", "sampled"])
def test_a_shuffle_without_seeds_before_the_shard_keeps_the_parts_disjoint(how, iterator):
    """An unseeded shuffle draws a new order per iterator: each replica's
    copy shuffled its own way, and their shards overlapped (49 distinct of
    64 elements read). It now shuffles alike on every replica, by seeds of
    its name: every element once an epoch, as on one device; a shuffle's
    next epoch is another order. `sample_from_datasets` draws its choices
    so too."""
    def make():
        rows = tf.data.Dataset.range(32)
        return {"rows": lambda: pn.shard(rows.shuffle(32)).batch(4),
                "batches": lambda: pn.shard(rows.shuffle(32).batch(4)),
                "files-then-rows": lambda: pn.shard(rows.shuffle(8).shuffle(32)).batch(4),
                "sampled": lambda: pn.shard(tf.data.Dataset.sample_from_datasets(
                    [tf.data.Dataset.range(16), tf.data.Dataset.range(16, 32)])).batch(4),
                }[how]().repeat(2)
    g = tf.Graph()
    with g.as_default():
        it = tf1.data.make_initializable_iterator(make()) if iterator == "initializable" \
            else tf1.data.make_one_shot_iterator(make())
        x = tf.identity(it.get_next(), name="x")
        w = tf1.get_variable("w", initializer=np.float32(1.0))
        tf1.train.GradientDescentOptimizer(0.0).minimize(
            tf.reduce_mean(tf.cast(x, tf.float32) * w), name="train")
        tf1.global_variables_initializer()
        inits = ["init"] + ([it.initializer.name] if iterator == "initializable" else [])
    with pn.get_runner(g, local(2)) as runner:
        runner.run(inits)
        epochs = [np.concatenate([runner.run("x:0") for _ in range(4)]) for _ in range(2)]
    for seen in epochs:
        assert sorted(seen.tolist()) == list(range(32))
    assert epochs[0].tolist() != list(range(32))
    if how != "sampled":        # a shuffle's next epoch is another order
        assert epochs[0].tolist() != epochs[1].tolist()


def test_a_parallel_map_before_the_shard_keeps_its_order():
    """`deterministic=False` lets a parallel map or interleave hand out
    elements as they finish, in another order in every copy; before a
    shard, its copies then overlap. It keeps the order there (after the
    shard it may reorder a replica's own elements)."""
    g = tf.Graph()
    with g.as_default():
        rows = tf.data.Dataset.range(8).map(lambda x: x, num_parallel_calls=2,
                                            deterministic=False)
        pn.shard(rows).map(lambda x: x, num_parallel_calls=2, deterministic=False)
    nodes = {n.name: n for n in g.as_graph_def().node}
    changed = data.seeded_shuffles(nodes)
    maps = sorted(n for n in nodes if nodes[n].op == "ParallelMapDatasetV2")
    assert list(changed) == [maps[0]] and changed[maps[0]].attr["deterministic"].s == b"true"


def test_file_list_dataset_replicas_read_disjoint_files(tmp_path):
    files = []
    for i in range(4):
        path = tmp_path / f"part-{i}.txt"
        path.write_text("".join(f"{i * 100 + j}\n" for j in range(5)))
        files.append(str(path))

    def make():
        names = pn.shard(tf.data.Dataset.from_tensor_slices(files))
        lines = names.interleave(tf.data.TextLineDataset, cycle_length=1)
        return lines.map(lambda s: tf.strings.to_number(s, tf.int64)).batch(5)

    g, init = reader_graph(make)
    with pn.get_runner(g, local(2)) as runner:
        runner.run(["init", init])
        batches = [runner.run("x:0", per_replica=True) for _ in range(2)]
    replica0 = {int(v) // 100 for step in batches for v in step[0]}
    replica1 = {int(v) // 100 for step in batches for v in step[1]}
    assert replica0 == {0, 2} and replica1 == {1, 3}    # whole files per replica


@pytest.mark.parametrize("run_option", ["hybrid", "allreduce"])
def test_a_feedable_iterator_switches_each_replica_between_its_shards(run_option):
    """TF1's feedable iterator (`Iterator.from_string_handle`, a train and a
    validation dataset behind one handle placeholder): each replica's copy
    of an iterator has a handle of its own; a fetched handle carries every
    replica's and a feed of it gives each replica its own. 6 training steps
    and a validation loss between them equal one device with the global
    batch (1e-6). Before, every replica was fed replica 0's handle, and
    TensorFlow refused it on the other devices."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(48, 3)).astype(np.float32), rng.normal(size=(48, 1)).astype(np.float32)

    def build(batch, parallel):
        g = tf.Graph()
        with g.as_default():
            part = pn.shard if parallel else (lambda ds: ds)
            train = part(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch).repeat())
            val = part(tf.data.Dataset.from_tensor_slices((x[:16], y[:16])).batch(batch))
            handle = tf1.placeholder(tf.string, [])
            it = tf1.data.Iterator.from_string_handle(handle, tf1.data.get_output_types(train),
                                                      tf1.data.get_output_shapes(train))
            xs, ys = it.get_next()
            w = tf1.get_variable("w", initializer=np.full((3, 1), 0.1, np.float32))
            loss = tf.reduce_mean(tf.square(tf.matmul(xs, w) - ys))
            step = tf1.train.MomentumOptimizer(0.05, 0.9).minimize(loss)
            iterators = [tf1.data.make_one_shot_iterator(d) for d in (train, val)]
            init = tf1.global_variables_initializer()
        return g, handle, [i.string_handle() for i in iterators], loss, step, init, w

    def run(session, built):
        _, handle, handles, loss, step, init, w = built
        session.run(init)
        train, val = session.run(handles)
        out = [session.run([loss, step], {handle: train})[0] for _ in range(3)]
        out.append(session.run(loss, {handle: val}))
        out += [session.run([loss, step], {handle: train})[0] for _ in range(3)]
        return out + list(session.run(w).ravel())
    one = build(16, False)
    with tf1.Session(graph=one[0]) as session:
        expected = run(session, one)
    two = build(8, True)
    with pn.get_runner(two[0], local(2), {"run_option": run_option}) as runner:
        got = run(runner, two)
    np.testing.assert_allclose(got, expected, atol=1e-6, rtol=0)


def test_shard_rejects_non_datasets():
    with pytest.raises(TypeError, match="tf.data.Dataset"):
        pn.shard([1, 2, 3])


def test_the_marked_constants_are_set_for_a_shard_and_nothing_else():
    from parallax_ng.graph.data import set_shard, shard_constant
    g = tf.Graph()
    with g.as_default():
        pn.shard(tf.data.Dataset.range(10))
        other = tf.constant(7, tf.int64, name="index")
    nodes = {n.name: n for n in g.as_graph_def().node}
    assert shard_constant("parallax_shard/num_shards") == "num_shards"
    assert shard_constant("outer/parallax_shard_1/index") == "index"
    assert shard_constant(other.op.name) is None
    num, index = nodes["parallax_shard/num_shards"], nodes["parallax_shard/index"]
    assert set_shard(num, 4, 3) and set_shard(index, 4, 3)
    assert not set_shard(nodes[other.op.name], 4, 3)
    assert tf.make_ndarray(num.attr["value"].tensor) == 4
    assert tf.make_ndarray(index.attr["value"].tensor) == 3
    assert tf.make_ndarray(nodes[other.op.name].attr["value"].tensor) == 7
    assert num.attr["value"].tensor.dtype == tf.int64.as_datatype_enum


def test_shards_that_end_apart_are_named():
    """49 rows over 2 replicas in batches of 8 (one device: 16): replica 0
    reads 25 rows in 4 batches, replica 1 24 in 3, so the epoch ends at the
    step where replica 1's iterator ends and the row replica 0 read in it
    goes untrained (one device trains it in a last batch of 1). A line
    names the iterator (initializable or one-shot; a padded_batch given
    to pn.shard too, whose rows pass an unbatch TensorFlow does not count:
    before, it said nothing); 50 rows, batches that drop their remainder,
    a repeated dataset or one fed by placeholders get none. In a runner:
    the line once, before the first step."""
    from parallax_ng.graph.data import uneven_ends

    def graph(rows, kind="one_shot", drop=False, repeat=False, padded=False):
        g = tf.Graph()
        with g.as_default():
            if kind == "fed":
                values = tf1.placeholder(tf.float32, [None, 3], name="values")
            else:
                values = np.zeros((rows, 3), np.float32)
            ds = tf.data.Dataset.from_tensor_slices(values).map(lambda v: v * 2)
            if padded:      # batched before the shard: its rows shared out
                ds = pn.shard(ds.padded_batch(8, drop_remainder=drop))
            else:
                ds = pn.shard(ds).batch(8, drop_remainder=drop)
            ds = ds.prefetch(1)
            ds = ds.repeat() if repeat else ds
            if kind == "one_shot":
                x = tf1.data.make_one_shot_iterator(ds).get_next()
            else:
                x = tf1.data.make_initializable_iterator(ds, shared_name="it").get_next()
            w = tf1.get_variable("w", [3, 1])
            tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(tf.matmul(x, w)))
        return g
    line = ("its pn.shard dataset gives 4 batches an epoch to replica 0 and 3 to replica 1 "
            "(of 2), so the step where the first of them ends is the epoch's end")
    for kind in ("one_shot", "initializable"):
        (said,) = uneven_ends(graph(49, kind), 2)
        assert line in said and said.startswith("iterator '"), said
        assert uneven_ends(graph(49, kind), 1) == []
    (said,) = uneven_ends(graph(49, padded=True), 2)
    assert line in said
    assert "gives 3 batches an epoch to replica 0 and 2 to replica 2 (of 3)" in \
        uneven_ends(graph(49), 3)[0]
    for quiet in (graph(50), graph(49, drop=True), graph(49, repeat=True),
                  graph(49, "fed"), graph(50, padded=True), graph(49, drop=True, padded=True)):
        assert uneven_ends(quiet, 2) == []


def test_a_runner_names_shards_that_end_apart_once(capsys):
    g = tf.Graph()
    with g.as_default():
        ds = pn.shard(tf.data.Dataset.range(49)).batch(8)
        x = tf.cast(tf1.data.make_one_shot_iterator(ds).get_next(), tf.float32)
        w = tf1.get_variable("w", [], initializer=tf1.ones_initializer())
        step = tf1.train.GradientDescentOptimizer(0.1).minimize(tf.reduce_mean(x * w))
        init = tf1.global_variables_initializer()
    with pn.get_runner(g, local(2)) as runner:
        runner.run(init)
        steps = 0
        with pytest.raises(tf.errors.OutOfRangeError):
            while True:
                runner.run(step)
                steps += 1
    assert steps == 3          # one device: 4 (16, 16, 16 and 1 rows)
    said = capsys.readouterr().err
    assert said.count("its pn.shard dataset gives 4 batches an epoch to replica 0 and 3") == 1


def padded(batch, how, loss_of):
    """Sequences of 2 to 11 ids, padded per batch: `how` "sharded-batches"
    shards the padded batches (`pn.shard(ds.padded_batch(b))`), "batched
    parts" pads each replica's part (`pn.shard(ds).padded_batch(b)`);
    the loss reads every position (`loss_of` "unmasked": the padding too;
    "last": the last position, a recurrent classifier's)."""
    rng = np.random.RandomState(0)
    seqs = [rng.randint(1, 20, rng.randint(2, 12)).astype(np.int32) for _ in range(96)]
    g = tf.Graph()
    with g.as_default():
        ds = tf.data.Dataset.from_generator(lambda: iter(seqs), output_signature=tf.TensorSpec(
            [None], tf.int32))
        ds = pn.shard(ds.padded_batch(batch)) if how == "sharded-batches" else \
            pn.shard(ds).padded_batch(batch)
        x = tf1.data.make_one_shot_iterator(ds.repeat()).get_next()
        emb = tf1.get_variable("emb", initializer=rng.randn(20, 4).astype(np.float32))
        w = tf1.get_variable("w", initializer=rng.randn(4, 20).astype(np.float32))
        per = tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=(x * 7) % 20, logits=tf.tensordot(tf.nn.embedding_lookup(emb, x), w, 1))
        loss = tf.reduce_mean(per if loss_of == "unmasked" else per[:, -1])
        train = tf1.train.AdamOptimizer(0.05).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "init": init, "loss": loss}


@pytest.mark.parametrize("loss_of", ["unmasked", "last"])
def test_padded_batches_sharded_pad_as_one_device(loss_of, capsys):
    """`pn.shard(ds.padded_batch(b))` pads the global batch to its longest
    row, as one device does, and shares its rows out: a loss that reads
    the padding equals one device's (every variable and slot within 1e-5
    after 6 steps; padded per replica, each part to its own longest, it
    was 0.07 apart for the unmasked mean, 0.31 for the last position)."""
    from models import train_both
    parallel, single, names = train_both(lambda b: padded(b, "sharded-batches", loss_of), 2, 6,
                                         batch=8)
    worst = max(float(np.max(np.abs(got - single[n]))) for n in names for got in parallel[n])
    assert worst <= 1e-5
    assert "comes after pn.shard()" not in capsys.readouterr().err


def test_dataset_ops_after_the_shard_that_act_on_a_part_are_named(capsys):
    """A filter (or take, skip, a grouping) between pn.shard and the batch
    keeps each replica's part's rows, and a padded_batch after it pads
    each part to its own longest: neither is one device's global batch,
    and the runner names them, once (a filter after the shard trained
    0.09 apart). Before the shard, or padded to a fixed shape, they are
    not named."""
    def graph(make):
        g = tf.Graph()
        with g.as_default():
            tf1.data.make_one_shot_iterator(make(tf.data.Dataset.range(40).map(
                lambda v: tf.range(v % 7)))).get_next()
        return g
    long = lambda t: tf.size(t) > 3                 # noqa: E731
    said = data.rows_apart(graph(lambda ds: pn.shard(ds).filter(long).take(30).padded_batch(4)))
    assert [line.split(" ")[0] for line in said] == ["FilterDataset", "TakeDataset",
                                                     "PaddedBatchDatasetV2"], said
    assert "apply it before pn.shard()" in said[0] and \
        "pn.shard(ds.padded_batch(b)) pads as one device does" in said[2]
    for quiet in (lambda ds: pn.shard(ds.filter(long)).padded_batch(4, padded_shapes=[7]),
                  lambda ds: pn.shard(ds.padded_batch(4)),
                  lambda ds: pn.shard(ds).batch(4).filter(lambda t: tf.size(t) > 0)):
        assert data.rows_apart(graph(quiet)) == []
    g, h = padded(8, "batched parts", "unmasked")
    with pn.get_runner(g, local(2)) as runner:
        runner.run(h["init"])
    assert capsys.readouterr().err.count("PaddedBatchDatasetV2 'PaddedBatchDatasetV2' comes "
                                         "after pn.shard()") == 1


def trained_apart(build, capsys):
    """build(b) trained 6 steps on 2 replicas and build(2b) on one device
    from the same start: the largest difference of a variable or slot, and
    what the run said."""
    from models import train_both
    parallel, single, names = train_both(build, 2, 6)
    worst = max(float(np.max(np.abs(got - single[n]))) for n in names for got in parallel[n])
    return worst, capsys.readouterr().err


def records(tmp_path, batch, how):
    """A regression read from 4 TFRecord files of tf.train.Examples (parsed
    by tf.io.parse_example per batch, as TensorFlow's input guides do):
    "rows" shards the records of the interleaved files, "files" the file
    names before the interleave."""
    rng = np.random.RandomState(4)
    x_all = rng.randn(96, 3).astype(np.float32)
    y_all = x_all @ rng.randn(3).astype(np.float32)
    for f in range(4):
        with tf.io.TFRecordWriter(str(tmp_path / f"part-{f}.tfrecord")) as out:
            for i in range(f * 24, f * 24 + 24):
                out.write(tf.train.Example(features=tf.train.Features(feature={
                    "x": tf.train.Feature(float_list=tf.train.FloatList(value=x_all[i])),
                    "y": tf.train.Feature(float_list=tf.train.FloatList(value=[y_all[i]]))}))
                          .SerializeToString())
    spec = {"x": tf.io.FixedLenFeature([3], tf.float32),
            "y": tf.io.FixedLenFeature([], tf.float32)}
    g = tf.Graph()
    with g.as_default():
        files = tf.data.Dataset.list_files(str(tmp_path / "*.tfrecord"), shuffle=False)
        read = lambda names: names.interleave(tf.data.TFRecordDataset, cycle_length=2)  # noqa
        ds = pn.shard(read(files)) if how == "rows" else read(pn.shard(files))
        parsed = tf.io.parse_example(tf1.data.make_one_shot_iterator(
            ds.batch(batch).repeat()).get_next(), spec)
        w = tf1.get_variable("w", [3], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(parsed["x"] * w, 1) - parsed["y"]))
        train = tf1.train.AdamOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "init": init}


def test_a_file_lists_rows_sharded_train_as_one_device_and_its_files_sharded_are_named(
        tmp_path, capsys):
    """A file list's records sharded (`pn.shard(files.interleave(...))`)
    train as one device with the global batch: every variable and slot
    within 1e-5 after 6 steps. Its files sharded, each replica's steps read
    its own files' rows (1.08 apart after 6 steps); the runner names the
    interleave, once, and the form above. Before, that said nothing."""
    for how in ("rows", "files"):
        worst, said = trained_apart(lambda b: records(tmp_path, b, how), capsys)
        if how == "rows":
            assert worst <= 1e-5 and "comes after pn.shard()" not in said
        else:
            assert worst > 1e-3
            assert said.count("comes after pn.shard() and makes rows of each replica's own "
                              "elements (whole files of a file list)") == 1, said
            assert "pn.shard(files.interleave(...))" in said

    def lines(make):
        g = tf.Graph()
        with g.as_default():
            tf1.data.make_one_shot_iterator(make(tf.data.Dataset.range(8))).get_next()
        return [line.split(" ")[0] for line in data.rows_apart(g)]
    rows = lambda v: tf.data.Dataset.range(v)       # noqa: E731
    assert lines(lambda ds: pn.shard(ds).flat_map(rows).batch(4)) == ["FlatMapDataset"]
    assert lines(lambda ds: pn.shard(ds).interleave(rows, num_parallel_calls=2).batch(4)) == \
        ["ParallelInterleaveDatasetV4"]
    assert lines(lambda ds: pn.shard(ds.flat_map(rows)).batch(4)) == []


def counted_rows(batch, where):
    """A regression whose inputs are scaled by each row's position in the
    data (`enumerate`), before the shard or after it."""
    rng = np.random.RandomState(6)
    scaled = lambda ds: ds.enumerate().map(                             # noqa: E731
        lambda i, r: (r[0] * tf.cast(i % 3, tf.float32), r[1]))
    g = tf.Graph()
    with g.as_default():
        rows = tf.data.Dataset.from_tensor_slices((rng.randn(96, 4).astype(np.float32),
                                                   rng.randn(96).astype(np.float32)))
        ds = pn.shard(scaled(rows)) if where == "before" else scaled(pn.shard(rows))
        x, y = tf1.data.make_one_shot_iterator(ds.batch(batch).repeat()).get_next()
        w = tf1.get_variable("w", [4], initializer=tf1.zeros_initializer())
        loss = tf.reduce_mean(tf.square(tf.reduce_sum(x * w, 1) - y))
        train = tf1.train.AdamOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    return g, {"train": train, "init": init}


def test_a_shuffle_zip_or_sample_after_the_shard_is_named(capsys):
    """A shuffle after pn.shard reorders each replica's part alone; a zip
    with elements not sharded (enumerate's counter) pairs a replica's rows
    with the first of them; sample_from_datasets of sharded parts draws
    each replica's own mix: none gives one device's global batch, and each
    is named (enumerate after the shard trained 0.15 apart after 6 steps,
    silently). Before the shard, or a zip of sharded parts, trains as one
    device: every variable and slot within 1e-5, no line."""
    for where in ("before", "after"):
        worst, said = trained_apart(lambda b: counted_rows(b, where), capsys)
        if where == "before":
            assert worst <= 1e-5 and "comes after pn.shard()" not in said
        else:
            assert worst > 1e-3 and said.count("ZipDataset 'ZipDataset' comes after pn.shard() "
                                               "and pairs each replica's part with elements "
                                               "not sharded") == 1, said

    def lines(make):
        g = tf.Graph()
        with g.as_default():
            ds = make(tf.data.Dataset.range(8), tf.data.Dataset.range(8))
            tf1.data.make_one_shot_iterator(ds.batch(2)).get_next()
        return [line.split(" ")[0] for line in data.rows_apart(g)]
    zip_, sample = tf.data.Dataset.zip, tf.data.Dataset.sample_from_datasets
    assert lines(lambda ds, other: pn.shard(ds).shuffle(4)) == ["ShuffleDataset"]
    assert lines(lambda ds, other: zip_((pn.shard(ds), other))) == ["ZipDataset"]
    assert lines(lambda ds, other: sample([pn.shard(ds), pn.shard(other)], seed=1)) == \
        ["DirectedInterleaveDataset"]
    for quiet in (lambda ds, other: pn.shard(ds.shuffle(4, seed=1)),
                  lambda ds, other: zip_((pn.shard(ds), pn.shard(other))),
                  lambda ds, other: pn.shard(sample([ds, other], seed=1))):
        assert lines(quiet) == []
