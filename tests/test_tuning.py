"""Bucket and fusion-buffer sizes tuned while training (`buckets.mode: auto`,
`fusion.buffer_bytes: auto`, parallax_ng/runtime/tuning.py): the choice is
the fastest size by measured steps; training moves between graphs exactly
(in-process and as a job whose workers all follow worker 0); drift tries
again; what cannot move says so."""
import re

import numpy as np
import pytest
import tensorflow as tf
from models import embedding_regression, local, read_name, variable_names

import parallax_ng as pn
from parallax_ng.build import Build, resolve
from parallax_ng.graph import frontend
from parallax_ng.runtime import tuning

tf1 = tf.compat.v1


class Recorded:
    """The Tuner's ways to plan and build, with real plans; a "Program" is
    the plan it was built from, so the test knows which size the graph has."""

    def __init__(self, config):
        g, _ = embedding_regression(4, "adam")
        self.build = Build(frontend.load(g), resolve(local(2), config))
        self.config = self.build.job.config
        self.graph = self.build.plan()        # the plan of the graph running now
        self.graphs = []

    def plan_of(self, config, profile):
        return self.build.configured(config).plan(profile)

    def program_of(self, plan, graph):
        self.graphs.append(graph)
        return plan

    def tuner(self, decide=lambda mine: mine, worker=0):
        return tuning.Tuner(self.config, self.plan_of, self.program_of, decide, worker)

    def step(self, tuner, seconds_by_buckets):
        """One training step timed by how many buckets the graph has."""
        moved = tuner.trained(seconds_by_buckets[len(self.graph.buckets)], None)
        if moved is not None:
            self.graph = moved
        return moved


def test_the_fastest_size_wins_and_each_packing_is_tried_once(capsys):
    """embedding_regression's three dense variables (22 floats in backward
    order out/v, dense/b, dense/w): one bucket (the default 4 MB threshold),
    two, and one per variable, each timed 2 steps after 1 of warm-up, in two
    passes (the second backwards, each trial on a graph built for it, and
    without one per variable: twice the fastest's time); two buckets are
    fastest, so the graph moves back to them."""
    r = Recorded({"run_option": "allreduce", "buckets": {"mode": "auto"},
                  "tuning": {"steps": 2, "warmup": 1}})
    tuner = r.tuner()
    times = {1: 0.0056, 2: 0.005, 3: 0.010}
    assert len(r.graph.buckets) == 1
    assert r.step(tuner, times) is None            # the round starts; the graph stays
    moves = [r.step(tuner, times) for _ in range(5 * 3)]
    landed = [len(m.buckets) for m in moves if m is not None]
    assert landed == [2, 3, 2, 1, 2]               # 1 2 3 | 2 1, then the fastest
    assert moves[-1] is not None and len(moves[-1].buckets) == 2
    chosen = tuner.tuned["buckets.bytes"]
    assert chosen["tried"][chosen["chosen"]] == 0.005 and len(chosen["tried"]) == 3
    assert r.graphs == [1, 2, 3, 4, 5]             # each graph's collectives keyed apart
    assert all(r.step(tuner, times) is None for _ in range(20))   # no drift watch
    said = capsys.readouterr().err
    assert re.search(r"tuned buckets.bytes = \d[\d,]* bytes \(2 buckets\) \(median step "
                     r"5.0 ms; tried 4,194,304 bytes \(1 bucket\): 5.6 ms, ", said), said


def test_plans_timed_while_training_keep_the_fastest_measured(capsys):
    """`tuning.plans: 3` on a 4-worker job with one server apart (100
    Mb/s): the planner's three fastest predictions are timed in two passes
    and training goes on with the fastest measured, here the third
    predicted (its plan: every variable's method as the candidate's), then
    the sizes are tuned within it; `parallax-ng plan` lists the plans."""
    from test_choice import NET, resources
    from test_traffic import classifier
    config = {"network": NET, "fusion": {"buffer_bytes": "auto"},
              "tuning": {"plans": 3, "steps": 2, "warmup": 0}}
    build = Build(frontend.load(classifier()), resolve(resources(4), config, planned=True))
    first = build.plan()
    top = tuning.ranked(first, 3)
    assert top[0].chosen and [c.seconds for c in top] == sorted(c.seconds for c in top)
    by_methods = {c.methods: c.label for c in top}
    built = []
    tuner = tuning.Tuner(build.job.config, lambda c, p: build.configured(c).plan(p),
                         lambda plan, n: built.append(plan) or plan, lambda mine: mine, 0)
    times = {top[0].label: 0.010, top[1].label: 0.012, top[2].label: 0.008}
    graph, labels = first, []
    for _ in range(1 + 2 * 5):
        label = by_methods.get(tuning.packing(graph, "plan"))
        labels.append(label)
        graph = tuner.trained(times[label], None) or graph
    assert labels[:7] == [top[0].label] * 3 + [top[1].label] * 2 + [top[2].label] * 2
    assert tuner.tuned["plan"]["chosen"] == top[2].label
    assert tuning.packing(graph, "plan") == top[2].methods
    assert graph.choice == () and graph.run_option == first.run_option
    said = capsys.readouterr().err
    assert f"tuned plan = '{top[2].label}' (median step 8.0 ms; tried '{top[0].label}'" in said
    assert tuning.candidates(lambda c: build.configured(c).plan(), build.job.config)[
        "plan"] == [(c.label, 1) for c in top]


def test_plan_lists_the_plans_training_will_time(tmp_path, capsys):
    """`parallax-ng plan` with `tuning.plans: 3` on a 4-worker job prints
    the three plans training times, the predicted fastest first."""
    import yaml
    from test_choice import NET, resources
    from test_traffic import classifier

    from parallax_ng.tools import cli
    meta, cfg, res = (str(tmp_path / n) for n in ("m.meta", "c.yaml", "r.yaml"))
    with classifier().as_default():
        tf1.train.export_meta_graph(filename=meta)
    config = {"network": NET, "tuning": {"plans": 3}}
    yaml.safe_dump(config, open(cfg, "w"))
    yaml.safe_dump(resources(4), open(res, "w"))
    assert cli.main(["plan", meta, "-c", cfg, "-r", res]) == 0
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("plans timed")]
    top = tuning.ranked(pn.transform_plan(classifier(), resources(4), config), 3)
    assert line == "plans timed while training (tuning.plans): " + ", ".join(
        f"'{c.label}'" for c in top)


def test_the_plans_timed_hold_one_without_server_work_and_one_with():
    """Where the fastest predictions all give the servers work, the last
    timed is the fastest without (and the other way round): the model
    leaves out the servers' CPU, so the trials compare both kinds."""
    from dataclasses import replace

    from passkit import tiny_graph

    from parallax_ng.planning.plan import Candidate

    def candidate(label, seconds, dense, sparse, chosen=False):
        return Candidate(label, "", 0, 0, 0, 0, 0, seconds, chosen,
                         (("emb", sparse), ("w", dense)))
    served = [candidate("bfb/ps", 0.008, "bfb", "ps", True), candidate("ps/ps", 0.0116, "ps", "ps"),
              candidate("allreduce/ps", 0.0121, "allreduce", "ps"),
              candidate("allreduce/allgather", 0.0123, "allreduce", "allgather"),
              candidate("ps/allgather", 0.013, "ps", "allgather")]
    plan = replace(pn.transform_plan(tiny_graph(), None, {}), choice=tuple(served))
    assert [c.label for c in tuning.ranked(plan, 3)] == ["bfb/ps", "ps/ps",
                                                          "allreduce/allgather"]
    assert [c.label for c in tuning.ranked(plan, 1)] == ["bfb/ps"]
    assert [tuning.serves(c) for c in served] == [True, True, True, False, True]
    ring = [replace(c, chosen=c.label == "allreduce/allgather") for c in served]
    plan = replace(plan, choice=tuple(ring))        # both kinds among the fastest already
    assert [c.label for c in tuning.ranked(plan, 3)] == ["allreduce/allgather", "bfb/ps",
                                                          "ps/ps"]
    alike = replace(plan, choice=tuple(c for c in served if tuning.serves(c)))
    assert [c.label for c in tuning.ranked(alike, 3)] == ["bfb/ps", "ps/ps", "allreduce/ps"]


def test_plan_lists_the_plans_auto_times_by_default(tmp_path, capsys):
    """With no `tuning.plans`, a job whose plans the planner weighs times
    the three fastest predicted; one it does not weigh (no servers, no
    kernels by factors) lists none."""
    import yaml
    from test_choice import NET, resources
    from test_traffic import classifier

    from parallax_ng.tools import cli
    meta, cfg, res = (str(tmp_path / n) for n in ("m.meta", "c.yaml", "r.yaml"))
    with classifier().as_default():
        tf1.train.export_meta_graph(filename=meta)
    yaml.safe_dump({"network": NET}, open(cfg, "w"))
    yaml.safe_dump(resources(4), open(res, "w"))
    assert cli.main(["plan", meta, "-c", cfg, "-r", res]) == 0
    line, = [x for x in capsys.readouterr().out.splitlines() if x.startswith("plans timed")]
    top = tuning.ranked(pn.transform_plan(classifier(), resources(4), {"network": NET}), 3)
    assert len(top) == tuning.AUTO_PLANS
    assert line == "plans timed while training (tuning.plans auto): " + ", ".join(
        f"'{c.label}'" for c in top)
    yaml.safe_dump({"run_option": "allreduce"}, open(cfg, "w"))
    assert cli.main(["plan", meta, "-c", cfg, "-r", res]) == 0
    assert "plans timed" not in capsys.readouterr().out


def test_auto_plans_are_three_where_the_planner_weighed_several_and_never_asked_for():
    """`tuning.plans: auto` (the default) settles on AUTO_PLANS for a job
    whose planner weighed plans, on 1 (no plan tuning) where it weighed
    none; a number the user set stays. Auto is not something the user
    asked for: a step that cannot move trains its prediction silently."""
    import warnings

    from test_choice import NET, resources
    from test_traffic import classifier
    config = pn.config.load_config({"network": NET})
    assert config.tuning.plans == "auto" and tuning.knobs(config) == []
    assert tuning.asked(config) == ""
    weighed = pn.transform_plan(classifier(), resources(4), {"network": NET})
    assert len(weighed.choice) > 1
    assert tuning.settled(config, weighed).tuning.plans == tuning.AUTO_PLANS
    assert tuning.knobs(tuning.settled(config, weighed)) == ["plan"]
    alone = pn.transform_plan(classifier(), local(2))
    assert alone.choice == () and tuning.settled(config, alone).tuning.plans == 1
    two = pn.config.load_config({"tuning": {"plans": 2}})
    assert tuning.settled(two, weighed).tuning.plans == 2
    assert tuning.asked(two) == "tuning.plans 2"
    tuner = tuning.Tuner(tuning.settled(config, weighed), None, None, None, 0, asked="")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tuning.usable(tuner, lambda jobs: "random ops in the step", 0) is None
    tuner.asked = "tuning.plans 3"
    with pytest.warns(UserWarning, match=r"tuning.plans 3: plans and sizes are not tried"):
        assert tuning.usable(tuner, lambda jobs: "random ops in the step", 0) is None


def test_one_plan_is_not_tuned_and_a_plan_count_below_one_names_the_key():
    assert tuning.knobs(pn.config.load_config({"tuning": {"plans": 1}})) == []
    with pytest.raises(pn.ConfigError, match=r"'tuning.plans' must be a whole number >= 1 "
                                             r"or auto, not 0"):
        pn.config.load_config({"tuning": {"plans": 0}})
    with pytest.raises(pn.ConfigError, match=r"'tuning.plans' .* or auto, not 'many'"):
        pn.config.load_config({"tuning": {"plans": "many"}})


@pytest.mark.parametrize("margin,lands", [(0.05, 1), (0.0, 2)])
def test_a_size_barely_faster_than_the_first_does_not_displace_it(capsys, margin, lands):
    """Two buckets 3% faster than the default one: under the default margin
    (5%) training goes back to the one bucket it began with and says why;
    with margin 0 the fastest wins. One per variable is 2x slower: dropped
    after the first pass either way."""
    r = Recorded({"run_option": "allreduce", "buckets": {"mode": "auto"},
                  "tuning": {"steps": 2, "warmup": 1, "margin": margin}})
    tuner = r.tuner()
    times = {1: 0.0052, 2: 0.00505, 3: 0.010}
    for _ in range(1 + 5 * 3):
        r.step(tuner, times)
    assert len(r.graph.buckets) == lands
    chosen = tuner.tuned["buckets.bytes"]
    assert chosen["tried"][chosen["chosen"]] == times[lands]
    said = capsys.readouterr().err
    assert ("kept, as" in said) == (lands == 1), said
    if lands == 1:
        assert re.search(r"tuned buckets.bytes = 4,194,304 bytes \(1 bucket\) \(median step "
                         r"5.2 ms; kept, as \d[\d,]* bytes \(2 buckets\) was not 5% faster;",
                         said), said


def test_a_size_faster_only_by_one_slow_pass_of_the_first_does_not_displace_it(capsys):
    """The one bucket training began with is slowed by noise in the first
    pass (5.8 ms against 4.0 for two buckets) and not in the second (5.0
    against 5.1): over both passes two buckets are 11% faster, but not in
    the second pass, so training keeps one bucket. With the second pass
    alike, two buckets win."""
    for second, lands in (({1: 0.005, 2: 0.0051, 3: 0.010}, 1),
                          ({1: 0.005, 2: 0.0045, 3: 0.010}, 2)):
        r = Recorded({"run_option": "allreduce", "buckets": {"mode": "auto"},
                      "tuning": {"steps": 2, "warmup": 1}})
        tuner = r.tuner()
        r.step(tuner, {1: 0.0058})                         # the round starts
        for i in range(5 * 3):           # pass 1: 1 2 3 buckets; pass 2: 2 1
            r.step(tuner, {1: 0.0058, 2: 0.004, 3: 0.010} if i < 9 else second)
        assert len(r.graph.buckets) == lands
        tried = tuner.tuned["buckets.bytes"]["tried"]
        assert tried[tuner.tuned["buckets.bytes"]["chosen"]] == pytest.approx(
            (0.0058 + 0.005) / 2 if lands == 1 else (0.004 + 0.0045) / 2)
        assert min(tried.values()) <= 0.95 * max(t for t in tried.values() if t < 0.01)
        said = capsys.readouterr().err
        assert ("kept, as" in said) == (lands == 1), said


def test_plan_lists_the_sizes_training_will_try(tmp_path, capsys):
    """`parallax-ng plan` with buckets auto prints each size tuning tries
    and the buckets it makes (the graph's own first, one per variable last),
    as the Tuner's trials are; JSON has them under "tuning"."""
    import json

    import yaml

    from parallax_ng.tools import cli
    g, _ = embedding_regression(4, "adam")
    meta, cfg, res = (str(tmp_path / n) for n in ("m.meta", "c.yaml", "r.yaml"))
    with g.as_default():
        tf1.train.export_meta_graph(filename=meta)
    yaml.safe_dump({"run_option": "allreduce", "buckets": {"mode": "auto"}}, open(cfg, "w"))
    yaml.safe_dump(local(2), open(res, "w"))
    assert cli.main(["plan", meta, "-c", cfg, "-r", res]) == 0
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("buckets.bytes")]
    assert line == ["buckets.bytes auto: sizes tried while training: 4,194,304 bytes "
                    "(1 bucket), 44 bytes (2 buckets), 22 bytes (3 buckets)"]
    assert cli.main(["plan", meta, "-c", cfg, "-r", res, "--json"]) == 0
    r = Recorded({"run_option": "allreduce", "buckets": {"mode": "auto"}})
    tried = [(4194304, 1)] + [(size, len(plan.buckets)) for size, plan in tuning.trials(
        lambda c: r.plan_of(c, None), r.config, r.graph, "buckets.bytes")]
    assert json.loads(capsys.readouterr().out)["tuning"] == {
        "buckets.bytes": [list(t) for t in tried]}


def test_every_worker_takes_worker_0s_choice():
    """A worker other than 0 passes None and takes what `decide` gives."""
    r = Recorded({"run_option": "allreduce", "buckets": {"mode": "auto"},
                  "tuning": {"steps": 1, "warmup": 0}})
    offered = []

    answers = [[4 * 2**20], 4 * 2**20]             # worker 0's second pass and choice:

    def decide(mine):                              # the default, one bucket
        offered.append(mine)
        return answers.pop(0)

    tuner = r.tuner(decide, worker=1)
    times = {1: 0.010, 2: 0.005, 3: 0.008}
    for _ in range(1 + 4):
        r.step(tuner, times)
    assert offered == [None, None] and tuner.tuned["buckets.bytes"]["chosen"] == 4 * 2**20
    assert len(r.graph.buckets) == 1               # moved back to the default


def test_steps_that_drift_start_the_sizes_again(capsys):
    """With `drift: 0.5` over windows of 4 steps: a window as fast as the
    choice goes on; one at twice its time tries every size again."""
    r = Recorded({"run_option": "allreduce", "buckets": {"mode": "auto"},
                  "tuning": {"steps": 1, "warmup": 0, "drift": 0.5, "window": 4}})
    tuner = r.tuner()
    times = {1: 0.010, 2: 0.005, 3: 0.008}
    for _ in range(1 + 5):                         # 1 2 3 | 2 1, then 2
        r.step(tuner, times)
    assert len(r.graph.buckets) == 2
    assert all(r.step(tuner, times) is None for _ in range(4))
    slow = {n: 2 * t for n, t in times.items()}
    assert all(r.step(tuner, slow) is None for _ in range(4))
    assert "trying the sizes again" in capsys.readouterr().err
    assert r.step(tuner, slow) is not None         # the first other size


def test_fusion_buffers_then_buckets_and_sizes_that_change_nothing_are_skipped():
    """Both knobs auto under hybrid with dense by fusion buffers: only the
    buffers have anything to try (nothing is all-reduced), so one round."""
    r = Recorded({"run_option": "hybrid", "dense_method": "bfb",
                  "buckets": {"mode": "auto"}, "fusion": {"buffer_bytes": "auto"},
                  "tuning": {"steps": 1, "warmup": 0}})
    assert tuning.knobs(r.config) == ["fusion.buffer_bytes", "buckets.bytes"]
    tuner = r.tuner()
    sizes = []
    for _ in range(30):
        moved = tuner.trained(0.01 / (1 + len(sizes)), None)
        if moved is not None:
            sizes.append(len(moved.buffers))
    assert list(tuner.tuned) == ["fusion.buffer_bytes"]
    tried = tuner.tuned["fusion.buffer_bytes"]["tried"]
    assert len(tried) == len(set(sizes) | {len(r.graph.buffers)}) >= 3   # and the first graph's


def train(config, steps, batch=4, replicas=2):
    """Every replica's variables after `steps` in-process steps, those of
    one device with the global batch from the same start, and the runner's
    `tuned`."""
    g, h = embedding_regression(batch, "adam", clip=True, ema=True)
    names = variable_names(g)
    reads = [read_name(v, g) for v in names]
    with pn.get_runner(g, local(replicas), config) as runner:
        runner.run([h["init"], h["iterator_init"]])
        start = runner.run(reads)
        for _ in range(steps):
            runner.run(h["train"])
        parallel = dict(zip(names, runner.run(reads, per_replica=True)))
        tuned = runner.tuned
    g1, h1 = embedding_regression(replicas * batch, "adam", clip=True, ema=True)
    with tf1.Session(graph=g1) as sess:
        sess.run([h1["init"], h1["iterator_init"]])
        for var, value in zip(names, start):
            op = [v for v in g1.get_collection(tf1.GraphKeys.GLOBAL_VARIABLES)
                  if v.op.name == var][0].initializer
            sess.run(op, {op.inputs[1]: value})
        for _ in range(steps):
            sess.run(h1["train"])
        single = dict(zip(names, sess.run(reads)))
    return parallel, single, tuned


@pytest.mark.parametrize("config", [
    {"run_option": "allreduce", "buckets": {"mode": "auto"}},
    {"run_option": "hybrid", "dense_method": "bfb", "fusion": {"buffer_bytes": "auto"}}],
    ids=["buckets", "fusion-buffers"])
def test_tuning_in_process_trains_like_one_device(config):
    """Adam, clipping, moving averages: 40 steps over which the graph moves
    to each size (two passes) and to the chosen one; every variable and
    slot of both replicas within 1e-5 of one device."""
    parallel, single, tuned = train({**config, "tuning": {"steps": 1, "warmup": 1}}, 40)
    (knob, record), = tuned.items()
    assert len(record["tried"]) >= 2 and record["chosen"] in record["tried"]
    for name, copies in parallel.items():
        for got in copies:
            assert np.max(np.abs(got - single[name])) <= 1e-5, name


@pytest.mark.parametrize("servers,args", [
    (1, ["--run-option", "hybrid", "--dense-method", "bfb"]),
    (0, ["--run-option", "allreduce"])], ids=["fusion-buffers-on-a-server", "buckets"])
def test_a_tuned_job_equals_one_device(tmp_path, servers, args):
    """2 workers x 2 devices: every worker moves at the same steps and takes
    worker 0's choice (else the collectives and the server's queues would
    not meet); worker 0 says what it chose; 24 steps equal one device."""
    import json

    from test_cluster import assert_matches_one_device, run_job
    config = {"buckets": {"mode": "auto"}, "fusion": {"buffer_bytes": "auto"},
              "tuning": {"steps": 1, "warmup": 0}}
    done, out, _ = run_job(tmp_path, 2, 2, "24", *args, "--config", json.dumps(config),
                           servers=servers)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.findall(r"\[worker (\d)\] parallax_ng: tuned (\S+) = ", done.stderr)
    knob = "fusion.buffer_bytes" if servers else "buckets.bytes"
    assert said == [("0", knob)], done.stderr[-3000:]
    assert_matches_one_device(out, 2, 2, steps=24)


@pytest.mark.parametrize("plans,tried", [(6, 4), ("auto", tuning.AUTO_PLANS)])
def test_a_job_timing_plans_equals_one_device(tmp_path, plans, tried):
    """2 workers and a server, hybrid with `tuning.plans: 6` (or auto, the
    default: the three fastest predicted): training moves between plans whose variables live on the server, in
    fusion buffers and on every worker (the checkpoint a move carries
    holds them all), every worker at the same steps; 30 steps equal one
    device (Adam, clipping, moving averages). The configured network makes
    the ring with all-gather the prediction (test_choice.py), a plan that
    leaves the server idle: it serves on while other plans are tried."""
    import json

    from test_choice import NET
    from test_cluster import assert_matches_one_device, run_job
    config = {"network": NET, "tuning": {"plans": plans, "steps": 1, "warmup": 0}}
    done, out, _ = run_job(tmp_path, 2, 1, "30", "--run-option", "hybrid", "--config",
                           json.dumps(config), servers=1)
    assert done.returncode == 0, done.stderr[-3000:]
    said = re.findall(r"\[worker (\d)\] parallax_ng: tuned plan = '([^']+)' .*tried (.*) in",
                      done.stderr)
    assert len(said) == 1 and said[0][0] == "0", done.stderr[-3000:]
    assert said[0][2].startswith("'dense allreduce, sparse allgather': ")
    assert said[0][2].count(" ms") >= tried, said      # ps, bfb and the ring, each beside ps
    assert_matches_one_device(out, 2, 1, steps=30)


def test_a_step_that_cannot_move_trains_with_the_default_sizes():
    """A seeded RandomShuffle in the step (no stateless twin, no fixed
    reservation per call) would start its stream again in another graph:
    tuning says so and the default sizes train."""
    g = tf.Graph()
    with g.as_default():
        x = tf1.placeholder(tf.float32, [None, 4])
        w = tf1.get_variable("w", initializer=np.ones([4, 1], np.float32))
        order = tf.random.shuffle(tf.range(4), seed=3)
        loss = tf.reduce_mean(tf.matmul(tf.gather(x, order, axis=1), w))
        train_op = tf1.train.GradientDescentOptimizer(0.1).minimize(loss)
        init = tf1.global_variables_initializer()
    with pytest.warns(UserWarning, match=r"buckets.mode auto: plans and sizes are not tried "
                                         r"while training \(random ops in the step"):
        runner = pn.get_runner(g, local(2), {"run_option": "allreduce",
                                             "buckets": {"mode": "auto"}})
    with runner:
        runner.run(init)
        for _ in range(5):
            runner.run(train_op, {x: np.ones([4, 4], np.float32)})
        assert runner.tuned == {} and runner.plan.buckets


@pytest.mark.parametrize("section,key,value,words", [
    ("fusion", "buffer_bytes", "fast", "or auto"),
    ("tuning", "steps", 0, ">= 1"),
    ("tuning", "warmup", -1, ">= 0"),
    ("tuning", "drift", -0.5, "never"),
    ("tuning", "window", 1.5, ">= 1"),
    ("tuning", "margin", 1, "below 1"),
    ("tuning", "margin", -0.1, "the fastest wins"),
    ("tuning", "sizes", [1], "known keys")])
def test_bad_tuning_settings_name_the_key(section, key, value, words):
    with pytest.raises(pn.ConfigError, match=re.escape(f"{section}.{key}") + ".*" +
                       re.escape(words)):
        pn.Config.from_dict({section: {key: value}})


def test_auto_is_a_bucket_mode():
    assert pn.Config.from_dict({"buckets": {"mode": "auto"}}).buckets.mode == "auto"
    with pytest.raises(pn.ConfigError, match="allowed: none, single, threshold, mgwfbp, auto"):
        pn.Config.from_dict({"buckets": {"mode": "fastest"}})


def test_a_tuned_step_with_a_candidate_sampler_draws_as_an_untuned_one():
    """Sampled softmax (a seeded candidate sampler, called again after each
    move to put its stream back): tuning moves the graph and every step's
    negatives and the variables equal an untuned runner's, bit for bit (two
    replicas: a sum of two is the same in any bucket)."""
    from test_counted_draws import SPLIT, VALUES, sampled_graph, sampled_steps
    runs = {}
    for mode in ("threshold", "auto"):
        g = sampled_graph()
        config = {"run_option": "allreduce", "buckets": {"mode": mode},
                  "tuning": {"steps": 1, "warmup": 0}, **SPLIT}
        with pn.get_runner(g, local(2), config) as runner:
            runner.run("init")
            drawn = sampled_steps(runner, 16)
            runs[mode] = (drawn, runner.run([read_name(v, g) for v in VALUES]), runner.tuned)
    assert len(runs["auto"][2]["buckets.bytes"]["tried"]) == 2 and not runs["threshold"][2]
    np.testing.assert_array_equal(runs["auto"][0], runs["threshold"][0])
    for got, want in zip(runs["auto"][1], runs["threshold"][1]):
        np.testing.assert_array_equal(got, want)


def test_keras_fit_with_tuned_buckets_equals_one_device():
    """Keras 3 `model.fit` (pn.parallelize) moves from graph to graph between
    its batches like any runner: the weights, optimizer variables and
    losses equal one device's."""
    from test_keras_fit import BATCH, check, data, twins   # Keras 3 by name
    parallel, single = twins()
    pn.parallelize(parallel, local(2), {"run_option": "allreduce", "buckets": {"mode": "auto"},
                                        "tuning": {"steps": 1, "warmup": 0}})
    x, y = data()
    h1 = parallel.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    h2 = single.fit(x, y, batch_size=BATCH, epochs=4, shuffle=False, verbose=0)
    assert parallel._parallax_ng.step.runner.tuned["buckets.bytes"]["tried"]
    check(parallel, single)
    np.testing.assert_allclose(h1.history["loss"], h2.history["loss"], atol=1e-5, rtol=0)
