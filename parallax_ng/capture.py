"""Run a user's training script only until it calls `get_runner`.

The command-line tools (`parallax-ng plan`, `parallax-ng diff`) use this to
get a script's graph, resources and config without training: inside
`capture()`, `get_runner` raises `GraphCaptured` carrying its arguments. It
derives from BaseException so a script's own `except Exception` cannot
swallow it.
"""
from __future__ import annotations

import contextlib
import contextvars
import os
import runpy
import sys

_capturing = contextvars.ContextVar("parallax_ng_capturing", default=False)


class GraphCaptured(BaseException):
    def __init__(self, graph, resource_info, config):
        super().__init__("get_runner called")
        self.graph, self.resource_info, self.config = graph, resource_info, config


def check(graph, resource_info, config) -> None:
    """Called by get_runner: stop the script here when capturing."""
    if _capturing.get():
        raise GraphCaptured(graph, resource_info, config)


@contextlib.contextmanager
def capture():
    token = _capturing.set(True)
    try:
        yield
    finally:
        _capturing.reset(token)


def run_script(path: str, args=()) -> GraphCaptured:
    """Run `path` as __main__ until it calls get_runner; return what it passed."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"script {path!r} does not exist")
    argv = sys.argv
    sys.argv = [path, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))
    try:
        with capture():
            runpy.run_path(path, run_name="__main__")
    except GraphCaptured as got:
        return got
    finally:
        sys.argv = argv
        sys.path.pop(0)
    raise RuntimeError(f"{path} finished without calling parallax_ng.get_runner")
