import os

import pytest

import parallax_ng as pn
from parallax_ng.graph import capture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_script_stops_at_get_runner_with_its_arguments(capsys):
    got = capture.run_script(os.path.join(ROOT, "examples", "linear_regression.py"),
                             ["--resources", "r.yaml", "--config", "c.yaml"])
    assert got.resource_info == "r.yaml" and got.config == "c.yaml"
    assert any(op.type == "ResourceApplyGradientDescent" for op in got.graph.get_operations())
    assert "step" not in capsys.readouterr().out      # it trained nothing


def test_outside_capture_get_runner_is_not_stopped():
    with pytest.raises(pn.GraphError, match="does not exist"):   # a real get_runner
        pn.get_runner("unused.meta")
    with capture.capture(), pytest.raises(capture.GraphCaptured) as got:
        pn.get_runner("unused.meta", "r.yaml")
    assert got.value.graph == "unused.meta" and got.value.resource_info == "r.yaml"


def test_scripts_that_never_call_get_runner(tmp_path):
    script = tmp_path / "noop.py"
    script.write_text("x = 1\n")
    with pytest.raises(RuntimeError, match="without calling"):
        capture.run_script(str(script))
    with pytest.raises(FileNotFoundError):
        capture.run_script(str(tmp_path / "missing.py"))
