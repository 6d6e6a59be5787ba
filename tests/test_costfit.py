"""The all-reduce micro-benchmark and its fit: the least squares on known
points, the sizes it measures, and a real run over two local devices."""
import pytest
import tensorflow as tf

from parallax_ng.planning.costfit import Fit, fit, measure, sizes


def test_the_fit_recovers_a_line_and_reports_its_error():
    points = [(m, 2e-4 + 1e-9 * m) for m in (4096, 65536, 2**20, 2**24)]
    got = fit(points)
    assert (got.a, got.b) == pytest.approx((2e-4, 1e-9), rel=1e-9)
    assert got.rms_error == pytest.approx(0, abs=1e-12)
    noisy = fit([(4096, 1e-3), (16384, 2e-3), (65536, 1e-3)])
    assert noisy.max_error > 0.2 and noisy.a >= 0 and noisy.b >= 0
    assert Fit.from_dict(got.to_dict()) == got
    assert "fit error: rms 0.0%" in got.format()


def test_a_negative_intercept_becomes_a_line_through_the_origin():
    got = fit([(1000, 1e-6), (2000, 3e-6), (3000, 5e-6)])   # t = -1e-6 + 2e-9 * M
    assert got.a == 0.0 and got.b > 0


def test_a_fit_needs_two_sizes():
    with pytest.raises(ValueError, match="needs two sizes"):
        fit([(4096, 1e-3)])


def test_sizes_grow_by_four_up_to_the_model_or_64_mb():
    assert sizes(1000) == [4096, 16384, 65536, 262144]
    assert sizes(10**6) == [4096, 16384, 65536, 262144, 1048576]
    assert sizes(10**12)[-1] == 64 * 2**20 and len(sizes(10**12)) == 8


def test_measured_on_two_local_devices():
    """Real collectives over two CPU devices: time grows with the size."""
    config = tf.compat.v1.ConfigProto(device_count={"CPU": 2})
    devices = [f"/job:localhost/replica:0/task:0/device:CPU:{k}" for k in range(2)]
    got = measure("", devices, 2, [4096, 2**22], config, 60, repeats=3)
    assert [m for m, _ in got.points] == [4096, 2**22]
    assert got.points[1][1] > got.points[0][1] > 0 and got.b > 0
    assert measure("", devices[:1], 1, [4096], config, 60) is None


def test_link_b_is_the_slope_of_the_two_largest_sizes_from_1_mb():
    """Small messages pull a least-squares b down; the bandwidth of large
    ones is the slope between the two largest points (from 1 MB)."""
    points = ((4096, 1.0e-3), (65536, 1.01e-3), (2**20, 1.2e-3), (2**22, 2.0e-3))
    f = fit(points)
    assert f.link_b() == pytest.approx((2.0e-3 - 1.2e-3) / (2**22 - 2**20))
    small = fit(points[:2])
    assert small.link_b() == small.b


def test_round_trip_to_a_server_and_a_session_run_are_measured_apart():
    """A job of one worker and one server in this process: the round trip
    is what a server update adds to a run; the run itself is measured on
    the worker's CPU."""
    from parallax_ng.cluster import ClusterInfo
    from parallax_ng.planning.costfit import round_trip
    from parallax_ng.tools.launch import _with_port
    info = ClusterInfo((_with_port("127.0.0.1"),), (_with_port("127.0.0.1"),), "worker", 0,
                       (("CPU", 0),))
    server = info.start_server()
    ClusterInfo(info.workers, info.ps, "ps", 0, (("CPU", 0),)).start_server()
    trip, run = round_trip(server.target, info.server_devices()[0], info.host,
                           info.session_config(), 60, repeats=10)
    assert 0 <= trip < 1 and 0 < run < 1


def test_the_matmul_rate_is_measured_at_the_largest_factored_variables_size():
    """Method factors' product: every replica multiplies the gathered
    factors of all replicas; its rate is measured at that size (the largest
    such variable, 2 replicas' rows), and there is none to measure without
    a variable whose gradient is a product."""
    from parallax_ng.planning.analysis import VariableInfo
    from parallax_ng.planning.costfit import matmul_rate
    small = VariableInfo("a", (8, 4), "float32", 128, False, None, "", 0, (None, 12))
    big = VariableInfo("b", (64, 256), "float32", 65536, False, None, "", 1, (16, 320))
    rate = matmul_rate({"a": small, "b": big}, 2)
    assert rate is not None and 1e8 < rate < 1e13      # FLOP/s of a CPU
    assert matmul_rate({"a": VariableInfo("a", (8, 4), "float32", 128, False, None, "", 0)},
                       2) is None
