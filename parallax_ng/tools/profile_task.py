"""A worker of `parallax-ng profile` of a job: the training script runs until
it calls get_runner; then the worker measures as a job's workers do before
their graphs are built (build.measure_job, with the steps asked for: worker
0's first steps, the all-reduce benchmark on every worker), worker 0 writes
the profile in the simulator's format, and the worker tells the servers it
is done.

The launcher runs it as `python -m parallax_ng.tools.profile_task SCRIPT
[ARGS...]` with PARALLAX_NG_PROFILE = "STEPS:PER_VARIABLE(0|1):PATH" and
the job's PARALLAX_NG_CLUSTER (tools/cli.py `profile`).
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

from .. import build
from ..cluster import PROFILE_ENV
from ..graph import frontend
from ..graph.capture import run_script
from ..runtime import heartbeat, serving


def main(argv: list[str]) -> int:
    steps, per_variable, path = os.environ[PROFILE_ENV].split(":", 2)
    got = run_script(argv[0], argv[1:])
    job = build.resolve(got.resource_info, got.config)
    info = job.cluster
    if info is None or info.task_type != "worker":
        raise RuntimeError(f"{__name__} runs as a worker of a launched job ({PROFILE_ENV} "
                           "and the job's cluster are set by `parallax-ng profile`)")
    heartbeat.set_timeout(job.config.communication.timeout_seconds)
    tg = frontend.load(got.graph, job.config.batch_norm, job.config.batch_feeds)
    server = info.start_server()
    shared = build.measure_job(build.Build(tg, job), server, int(steps))
    if info.task == 0:
        profile = build.job_profile(shared)
        if profile is None:
            raise RuntimeError(f"the job's first step was not measured: {shared['source']}")
        profile = replace(profile, rows=dict(shared.get("rows", {})), steps=int(steps))
        with open(path, "w") as f:
            json.dump(profile.simulator(tg, per_variable == "1"), f, indent=1)
            f.write("\n")
        print(profile.format(), flush=True)
    if info.ps:
        serving.tell_done(info, server)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
