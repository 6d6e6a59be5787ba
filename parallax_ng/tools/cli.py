"""`parallax-ng`: inspect what parallax_ng does to a training graph.

    parallax-ng run SCRIPT -r RESOURCES [-c CONFIG] [--chief-only] [--verbose]
                    [--restarts N] [--run-dir DIR] [--grace-seconds S]
                    [--timeline FILE] [-- ARGS]
    parallax-ng tf-config -r RESOURCES --task worker:I|ps:J
    parallax-ng timeline FILE [--png OUT]
    parallax-ng plan SOURCE [-r RESOURCES] [-c CONFIG] [--json] [-- ARGS]
    parallax-ng diff SOURCE [-r RESOURCES] [-c CONFIG] [--out DIR] [--batch N] [-- ARGS]
    parallax-ng profile SCRIPT [-r RESOURCES] [-c CONFIG] [--steps N] [--out P.json]
                        [--per-variable] [-- ARGS]
    parallax-ng simulate --profile P.json [--a A --b B | --nodes N --alpha S --beta S]
                         [--strategies S,...] [--json]

SOURCE is a training script (run until it calls get_runner; its own
resource and config arguments are used unless -r/-c are given) or an
exported MetaGraphDef (.meta). ARGS go to the script: everything after
`--`, and any option parallax-ng does not know (so `--steps 10` works
without `--`; put the script's own -r, -c or -h after `--`).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

from ..errors import ParallaxError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="parallax-ng", description=__doc__.split("\n")[0],
        epilog="Arguments for the script: after `--`, or any option parallax-ng does "
               "not know, e.g. `parallax-ng run train.py -r r.yaml -- --steps 10`.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="start a multi-process job on this machine",
                         epilog="Script arguments: after `--` (or options parallax-ng "
                                "does not know).")
    run.add_argument("script", help="the training script every worker runs")
    run.add_argument("-r", "--resources", required=True, help="resource YAML: hosts, ps")
    run.add_argument("-c", "--config", help="config YAML for every worker")
    run.add_argument("--chief-only", action="store_true",
                     help="show only worker 0's output (another task's last lines are "
                          "shown if it fails)")
    run.add_argument("--verbose", action="store_true",
                     help="also show TensorFlow's harmless start-up and step-cleanup lines")
    run.add_argument("--restarts", type=int, default=0, metavar="N",
                     help="when a task dies or hangs, stop every task and start the job "
                          "again from its last checkpoint, up to N times")
    run.add_argument("--grace-seconds", type=float, default=30.0, metavar="S",
                     help="after SIGTERM (to the launcher or a task), how long the workers "
                          "have to save a checkpoint and stop (default 30)")
    run.add_argument("--timeline", metavar="FILE",
                     help="trace the workers' steps (config timeline.steps after "
                          "timeline.skip) into one Chrome trace, FILE (Perfetto, "
                          "chrome://tracing)")
    run.add_argument("--run-dir", metavar="DIR",
                     help="with --restarts and no checkpoint.dir in the config: the "
                          "checkpoints go to DIR/checkpoints (default: a new "
                          "parallax_ng_run-<time> here)")
    run.add_argument("--no-fork", action="store_true",
                     help="start every task on this machine as a process of its own "
                          "(default: forked from one that imported TensorFlow, so the job "
                          "starts and restarts without importing it per task)")
    tl = sub.add_parser("timeline", help="per task and step of a timeline (--timeline): "
                                         "compute, exposed communication, idle")
    tl.add_argument("file", help="the Chrome trace `run --timeline` or config timeline wrote")
    tl.add_argument("--png", metavar="OUT", help="also draw it (matplotlib)")
    tfc = sub.add_parser("tf-config", help="print one task's TF_CONFIG (for an orchestrator "
                                           "that starts each task: Kubernetes, Slurm)")
    tfc.add_argument("-r", "--resources", required=True, help="resource YAML: hosts, ps")
    tfc.add_argument("--task", required=True, help="worker:I or ps:J")
    for name, text in (("plan", "print the plan: method and traffic per variable"),
                       ("diff", "show what each pass changed, as text and HTML")):
        p = sub.add_parser(name, help=text)
        p.add_argument("source", help="training script (.py) or MetaGraphDef (.meta)")
        p.add_argument("-r", "--resources", help="resource YAML (default: the script's)")
        p.add_argument("-c", "--config", help="config YAML (default: the script's)")
        if name == "plan":
            p.add_argument("--json", action="store_true", help="print the plan as JSON")
            p.add_argument("--profile", type=int, default=0, metavar="N",
                           help="train the script's first N steps and print the plan "
                                "with what they measured (sparsity, gradient order, "
                                "layer times)")
        else:
            p.add_argument("--out", help="write diff.txt, diff.html, diff.dot here")
            p.add_argument("--batch", type=int, help="size of unknown batch dimensions")
    prof = sub.add_parser("profile", help="train a script's first steps on this machine's "
                                          "devices and write its layer profile and the "
                                          "all-reduce cost a + b*M")
    prof.add_argument("script", help="the training script (.py)")
    prof.add_argument("-r", "--resources", help="resource YAML (default: the script's); "
                                                "with several hosts the job is started "
                                                "and measured as `run` would start it")
    prof.add_argument("-c", "--config", help="config YAML (default: the script's)")
    prof.add_argument("--steps", type=int, default=2, help="training steps measured")
    prof.add_argument("--out", help="write the profile here (JSON, the simulator's format)")
    prof.add_argument("--per-variable", action="store_true",
                      help="a layer per variable (as the planner's buckets see them), not "
                           "per group of gradients ready together")
    sim = sub.add_parser("simulate", help="predict the iteration time of all-reduce "
                                          "bucketings from a layer profile")
    sim.add_argument("--profile", required=True,
                     help='JSON: {"forward_time": s, "layers": [{"name", "bytes", '
                          '"backward_time"}, ...]}, layers input to output')
    sim.add_argument("--a", type=float, help="seconds per all-reduce (with --b; default: "
                                             "the profile's fitted cost, if it has one)")
    sim.add_argument("--b", type=float, help="seconds per byte all-reduced (with --a)")
    sim.add_argument("--nodes", type=int, help="a network of N nodes (with --alpha, --beta): "
                                                "ring all-reduce, parameter servers")
    sim.add_argument("--alpha", type=float, help="seconds per message between two nodes")
    sim.add_argument("--beta", type=float, help="seconds per byte between two nodes")
    sim.add_argument("--strategies", default="wfbp,single,threshold:4194304,mgwfbp",
                     help="comma-separated: wfbp, single, threshold:BYTES, mgwfbp, "
                          "bfb:SERVERS, ps:SERVERS (the last two need a network)")
    sim.add_argument("--json", action="store_true", help="print the result as JSON")
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:            # everything after -- is the script's
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    opts, unknown = parser.parse_known_args(argv)
    opts.args = unknown + extra
    if opts.command == "run":
        from .launch import launch
        try:
            return launch(opts.script, opts.resources, opts.config, opts.args,
                          chief_only=opts.chief_only, verbose=opts.verbose,
                          restarts=opts.restarts, run_dir=opts.run_dir,
                          grace_seconds=opts.grace_seconds, timeline_file=opts.timeline,
                          fork=not opts.no_fork)
        except ParallaxError as e:
            print(f"parallax-ng run: {e}", file=sys.stderr)
            return 2
    if opts.command == "timeline":
        return _timeline(opts.file, opts.png)
    if opts.command == "tf-config":
        from ..cluster import tf_config
        from ..resources import load_resources
        try:
            print(json.dumps(tf_config(load_resources(opts.resources), opts.task)))
            return 0
        except ParallaxError as e:
            print(f"parallax-ng tf-config: {e}", file=sys.stderr)
            return 2
    if opts.command == "profile":
        try:
            return _profile(opts)
        except (ParallaxError, OSError, RuntimeError, ValueError) as e:
            print(f"parallax-ng profile: {e}", file=sys.stderr)
            return 2
    if opts.command == "simulate":
        try:
            return _simulate(opts)
        except (ParallaxError, OSError, ValueError) as e:
            print(f"parallax-ng simulate: {e}", file=sys.stderr)
            return 2
    try:
        graph, resources, config = _load(opts)
        return {"plan": _plan, "diff": _diff}[opts.command](opts, graph, resources, config)
    except (ParallaxError, FileNotFoundError, RuntimeError) as e:
        print(f"parallax-ng {opts.command}: {e}", file=sys.stderr)
        return 2


def _load(opts):
    if getattr(opts, "profile", 0):
        return None, None, None          # _plan runs the script itself
    if opts.source.endswith(".py"):
        from ..graph.capture import run_script
        got = run_script(opts.source, opts.args)
        return (got.graph, opts.resources or got.resource_info, opts.config or got.config)
    if not os.path.exists(opts.source):
        raise FileNotFoundError(f"{opts.source!r} does not exist")
    return opts.source, opts.resources, opts.config


def _plan(opts, graph, resources, config) -> int:
    if opts.profile:
        return _profiled_plan(opts)
    from .. import build, transform_plan
    from ..runtime import tuning
    job = build.resolve(resources, config, planned=True)
    if job.config.l2l.enabled:
        plan, tried = transform_plan(graph, resources, config), {}
    else:                              # one Build planned with each size tuning tries
        from ..graph import frontend
        made = build.Build(frontend.load(graph, job.config.batch_norm,
                                         job.config.batch_feeds), job)
        plan = made.plan()
        config = tuning.settled(job.config, plan)
        tried = tuning.candidates(lambda c: made.configured(c).plan(), config) \
            if tuning.knobs(config) else {}
    if opts.json:
        print(json.dumps({**plan.to_dict(), "tuning": tried}, indent=1))
        return 0
    print(plan.format())
    auto = " auto" if job.config.tuning.plans == "auto" else ""
    for knob, sizes in tried.items():  # tuning.plans, buckets.mode / fusion.buffer_bytes auto
        print((f"plans timed while training (tuning.plans{auto}): " if knob == "plan" else
               f"{knob} auto: sizes tried while training: ") + ", ".join(
            tuning.named(knob, size, count) for size, count in sizes))
    return 0


def _profiled_plan(opts) -> int:
    """Train the script's first steps (its own resources and config) and
    print the plan with what they measured."""
    if not opts.source.endswith(".py") or opts.resources or opts.config:
        raise RuntimeError("plan --profile trains a script (.py) with the resources and "
                           "config it gives get_runner; drop -r/-c")
    from ..graph.capture import run_script
    got = run_script(opts.source, opts.args, profile=opts.profile)
    if opts.json:
        print(json.dumps({**got.plan.to_dict(), "profile": got.profile.to_dict()}, indent=1))
    else:
        print(got.plan.format() + "\n" + got.profile.format())
    return 0


def _profile(opts) -> int:
    """Train the script's first steps with the profile and the all-reduce
    benchmark, print them, write the simulator's JSON."""
    if opts.steps < 1:
        raise ValueError(f"--steps must be at least 1, not {opts.steps}")
    from ..resources import load_resources
    if opts.resources and len(load_resources(opts.resources).hosts) > 1:
        return _profile_job(opts)
    from ..graph.capture import run_script
    got = run_script(opts.script, opts.args, profile=opts.steps, fit=True,
                     resources=opts.resources, config=opts.config)
    data = got.profile.simulator(got.tg, opts.per_variable)
    print(got.profile.format())
    if got.profile.allreduce is None:
        print(f"no all-reduce benchmark: the plan has {len(got.plan.devices)} replica(s) on "
              "this machine (list several devices, or use a job)")
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(data, f, indent=1)
            f.write("\n")
        print(f"wrote {opts.out}: {len(data['layers'])} layers; predict with "
              f"parallax-ng simulate --profile {opts.out}")
    return 0


def _profile_job(opts) -> int:
    """Start the job; its workers run the script until get_runner, measure
    as before building their graphs (worker 0's first steps, the all-reduce
    benchmark on all) and stop; worker 0 writes the profile
    (tools/profile_task.py)."""
    import tempfile

    from ..cluster import PROFILE_ENV
    from .launch import launch
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.abspath(opts.out or os.path.join(tmp, "profile.json"))
        done = launch(opts.script, opts.resources, opts.config, opts.args, chief_only=True,
                      env={PROFILE_ENV: f"{opts.steps}:{int(opts.per_variable)}:{path}"},
                      runner="parallax_ng.tools.profile_task")
        if done != 0:
            return done
        with open(path) as f:
            layers = len(json.load(f)["layers"])
    if opts.out:
        print(f"wrote {opts.out}: {layers} layers of the job's worker 0; predict with "
              f"parallax-ng simulate --profile {opts.out}")
    return 0


def _simulate(opts) -> int:
    from ..planning import buckets
    with open(opts.profile) as f:
        data = json.load(f)
    forward, layers = buckets.load_profile(data)
    fitted = data.get("allreduce") if isinstance(data, dict) else None
    if opts.a is None and opts.nodes is None and fitted:    # the profile's own fit
        opts.a, opts.b = float(fitted["a"]), float(fitted["b"])
    given = lambda *names: [n for n in names if getattr(opts, n) is not None]  # noqa: E731
    if len(given("a", "b")) == 1 or len(given("nodes", "alpha", "beta")) in (1, 2):
        raise ValueError("give --a with --b, and --nodes with --alpha and --beta")
    if not given("a", "nodes"):
        raise ValueError("give the all-reduce cost (--a, --b) or a network "
                         "(--nodes, --alpha, --beta), or a profile with its fit "
                         "(parallax-ng profile)")
    if opts.nodes is not None and opts.nodes < 1:
        raise ValueError(f"--nodes must be at least 1, not {opts.nodes}")
    cost = buckets.Cost(opts.a, opts.b) if opts.a is not None else None
    network = (buckets.Network(opts.nodes, opts.alpha, opts.beta)
               if opts.nodes is not None else None)
    result = buckets.simulate(forward, layers, [s for s in opts.strategies.split(",") if s],
                              cost, network)
    if opts.json:
        print(json.dumps({"strategies": result}, indent=1))
        return 0
    compute = forward + sum(layer.backward_time for layer in layers)
    print(f"{'strategy':24} {'iteration ms':>13} {'messages':>9} {'compute share':>14}")
    for name, r in result.items():
        print(f"{name:24} {r['iteration_time'] * 1e3:13.3f} {len(r['buckets']):9d} "
              f"{compute / r['iteration_time'] if r['iteration_time'] else 1.0:14.3f}")
    return 0


def _diff(opts, graph, resources, config) -> int:
    from .. import transform
    from . import diff
    ir, ctx, manager = transform(graph, resources, config, keep_graphs=True)
    seconds = {r.name: r.seconds for r in manager.records}
    diffs = diff.diff_pipeline(manager.graphs, seconds)
    print(diff.render_text(diffs, ir, ctx.tg, opts.batch))
    if opts.out:
        os.makedirs(opts.out, exist_ok=True)
        files = {"diff.txt": diff.render_text(diffs, ir, ctx.tg, opts.batch),
                 "diff.dot": diff.render_dot(ir, diffs, ctx.tg),
                 "diff.html": diff.render_html(diffs, ir, ctx.tg, opts.batch)}
        for name, text in files.items():
            with open(os.path.join(opts.out, name), "w") as f:
                f.write(text)
        print(f"\nwrote {', '.join(files)} to {opts.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _timeline(path: str, png: str | None) -> int:
    """Print each task's mean step split (compute, exposed communication,
    idle) and the traced steps' communication by what it carries."""
    from ..runtime import timeline
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        print(f"parallax-ng timeline: cannot read {path!r} as a trace: {e}", file=sys.stderr)
        return 2
    shares = timeline.summary(data)
    if not shares:
        print(f"parallax-ng timeline: {path!r} holds no traced step", file=sys.stderr)
        return 2
    print(f"{'task':12} {'steps':>5} {'ms/step':>8} {'compute':>8} {'exposed':>8} {'idle':>8}")
    for task in sorted({s.task for s in shares}):
        mine = [s for s in shares if s.task == task]
        mean = {k: 1e3 * sum(getattr(s, k) for s in mine) / len(mine)
                for k in ("seconds", "compute", "exposed", "idle")}
        print(f"{task:12} {len(mine):5d} {mean['seconds']:8.2f} {mean['compute']:8.2f} "
              f"{mean['exposed']:8.2f} {mean['idle']:8.2f}")
    steps = len({(s.task, s.step) for s in shares})
    print("bytes received by what they carry, MB per traced step of a task:")
    for what, nbytes in sorted(timeline.received(data).items(), key=lambda kv: -kv[1])[:15]:
        print(f"  {what:40} {nbytes / steps / 1e6:9.3f}")
    if png:
        try:
            timeline.draw(shares, png)
        except ParallaxError as e:
            print(f"parallax-ng timeline: {e}", file=sys.stderr)
            return 2
        print(f"wrote {png}")
    return 0
