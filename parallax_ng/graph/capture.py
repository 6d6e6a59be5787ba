"""Run a user's training script only until it calls `get_runner`, or until
its first training steps were measured.

The command-line tools (`parallax-ng plan`, `parallax-ng diff`) use this to
get a script's graph, resources and config without training: inside
`capture()`, `get_runner` raises `GraphCaptured` carrying its arguments.
Inside `capture(profile=N)` the script trains for real until the runner has
profiled N training steps, then `Profiled` carries the measured plan and
profile out. Both derive from BaseException so a script's own
`except Exception` cannot swallow them.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import runpy
import sys

# None: not capturing; "graph": stop at get_runner; an int N: stop after N profiled steps
_capturing = contextvars.ContextVar("parallax_ng_capturing", default=None)
# when profiling: {"fit": bool, "resources"/"config": given instead of the script's, or None}
_options = contextvars.ContextVar("parallax_ng_capture_options", default={})


class GraphCaptured(BaseException):
    def __init__(self, graph, resource_info, config):
        super().__init__("get_runner called")
        self.graph, self.resource_info, self.config = graph, resource_info, config


class Profiled(BaseException):
    def __init__(self, plan, profile, tg=None):
        super().__init__("first training steps profiled")
        self.plan, self.profile, self.tg = plan, profile, tg


def check(graph, resource_info, config) -> int:
    """Called by get_runner: stop the script here when capturing; the steps
    to profile when capturing a profile (else 0)."""
    mode = _capturing.get()
    if mode == "graph":
        raise GraphCaptured(graph, resource_info, config)
    return mode or 0


def resources(resource_info):
    """The resources get_runner uses: the capture's, if it was given some."""
    return _options.get().get("resources") or resource_info


def config(given):
    """The config get_runner uses: the capture's, if it was given one."""
    return _options.get().get("config") or given


def wants_fit() -> bool:
    """Whether the profile being captured should hold the all-reduce fit."""
    return bool(_options.get().get("fit"))


def profiled(plan, profile, tg=None) -> None:
    """Called by the runner once its profile is complete: stop the script
    when capturing a profile."""
    if isinstance(_capturing.get(), int):
        raise Profiled(plan, profile, tg)


@contextlib.contextmanager
def capture(profile: int = 0, fit: bool = False, resources=None, config=None):
    token = _capturing.set(profile or "graph")
    options = _options.set({"fit": fit, "resources": resources, "config": config})
    try:
        yield
    finally:
        _capturing.reset(token)
        _options.reset(options)


def run_script(path: str, args=(), profile: int = 0, fit: bool = False, resources=None,
               config=None):
    """Run `path` as __main__ until it calls get_runner (GraphCaptured), or,
    with `profile`, until its runner profiled that many training steps
    (Profiled), with the all-reduce fit when `fit`, on `resources` and with
    `config` instead of the script's when given."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"script {path!r} does not exist")
    argv = sys.argv
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with capture(profile, fit, resources, config):
            runpy.run_path(path, run_name="__main__")
    except (GraphCaptured, Profiled) as got:
        return got
    finally:
        sys.argv = argv
        sys.path.pop(0)
    if profile:
        raise RuntimeError(f"{path} finished before its runner trained {profile} step(s)")
    raise RuntimeError(f"{path} finished without calling parallax_ng.get_runner")
