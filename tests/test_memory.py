"""parallax_ng/runtime/memory.py: a step's peak live bytes per device, from real
traced runs on two CPU devices (which share one allocator)."""
import numpy as np
import tensorflow as tf

from parallax_ng.runtime import memory

tf1 = tf.compat.v1
MB4 = 1000 * 1000 * 4      # one [1000, 1000] float32 tensor


def run_traced(graph, fetch, feeds):
    config = tf1.ConfigProto(device_count={"CPU": 2})
    with tf1.Session(graph=graph, config=config) as sess:
        sess.run([op for op in graph.get_operations() if op.type == "AssignVariableOp"])
        md = tf1.RunMetadata()
        sess.run(fetch, feeds, options=memory.traced(), run_metadata=md)
    return md


def on(peaks: dict, device: str) -> int:
    return sum(v for d, v in peaks.items() if d.endswith(device))


def products(live: int):
    """On CPU:1, `live` products of x that all live until one sum of them;
    on CPU:0, the input only."""
    g = tf.Graph()
    with g.as_default():
        with tf.device("/device:CPU:0"):
            x = tf1.placeholder(tf.float32, [1000, 1000])
        with tf.device("/device:CPU:1"):
            parts = [tf.matmul(x, x) * float(i + 1) for i in range(live)]
            total = tf.reduce_sum(tf.add_n(parts))
    return g, total, x


def test_the_peak_grows_with_the_tensors_alive_at_once_on_that_device():
    peaks = {}
    for live in (2, 6):
        g, total, x = products(live)
        md = run_traced(g, total, {x: np.ones([1000, 1000], np.float32)})
        got = memory.step_peaks(md)
        cpu1 = on(got, "CPU:1")
        cpu0 = on(got, "CPU:0")
        assert live * MB4 <= cpu1 <= (live + 3) * MB4, (live, cpu1)
        assert cpu0 <= 2 * MB4     # the fed input at most: the products are CPU:1's
        peaks[live] = cpu1
    assert peaks[6] - peaks[2] >= 4 * MB4


def test_a_chain_frees_as_it_goes():
    """A chain of products holds a couple of tensors at a time, however long."""
    for depth in (2, 8):
        g = tf.Graph()
        with g.as_default(), tf.device("/device:CPU:1"):
            x = tf1.placeholder(tf.float32, [1000, 1000])
            y = x
            for i in range(depth):
                y = tf.matmul(y, x) + float(i)
            total = tf.reduce_sum(y)
        md = run_traced(g, total, {x: np.ones([1000, 1000], np.float32) * 1e-3})
        cpu1 = on(memory.step_peaks(md), "CPU:1")
        assert 1 * MB4 <= cpu1 <= 3 * MB4, (depth, cpu1)


def test_variables_on_a_device_are_resident_bytes():
    g = tf.Graph()
    with g.as_default():
        with tf.device("/device:CPU:1"):
            tf1.get_variable("a", [100, 10], use_resource=True)
            tf1.get_variable("b", [7], tf.float64, use_resource=True)
        with tf.device("/device:CPU:0"):
            tf1.get_variable("c", [5], use_resource=True)
    assert memory.resident_bytes(g, "/device:CPU:1") == 100 * 10 * 4 + 7 * 8
    assert memory.resident_bytes(g, "/job:localhost/replica:0/task:0/device:CPU:0") == 20


def test_a_deeper_stack_holds_more_on_its_device():
    """examples/transformer_stack.py on a stand-in device: the weights, the
    slots and the activations kept for the backward pass grow with depth
    (benchmarks/l2l_memory.py prints the table)."""
    import os
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(
        os.path.abspath(__file__))), "benchmarks"))
    import l2l_memory
    small = ["--dim", "32", "--ffn", "64", "--batch", "8"]
    (r2, p2), (r4, p4) = (l2l_memory.device_bytes(n, "baseline", argv=small) for n in (2, 4))
    # two more layers: their weights (attention 4 d^2, feed-forward 2 d f + f,
    # two norms 4 d) and Adam's two slots of each, float32
    d, f = 32, 64
    assert r4 - r2 == 2 * 3 * 4 * (4 * d * d + 2 * d * f + f + 4 * d)
    assert p4 > 1.5 * p2, (p2, p4)


def test_a_traced_run_in_this_process_keeps_its_stats_and_logs_no_gpu_warning():
    """compat.trace_level: a direct session's traced run (a job times its
    first steps so) records the same allocations at SOFTWARE_TRACE, without
    the warning FULL_TRACE logs on a CPU-only machine at every run; a gRPC
    server's session keeps FULL_TRACE (its workers record nothing for less)."""
    import os
    import subprocess
    import sys

    from parallax_ng import compat
    assert compat.trace_level("grpc://127.0.0.1:1") == tf1.RunOptions.FULL_TRACE
    if tf.config.list_physical_devices("GPU"):
        return
    assert compat.trace_level() == tf1.RunOptions.SOFTWARE_TRACE
    code = ("import tensorflow as tf\nfrom parallax_ng.runtime import memory\n"
            "g = tf.Graph()\nwith g.as_default():\n"
            "    x = tf.compat.v1.placeholder(tf.float32, [64, 64])\n    y = tf.matmul(x, x)\n"
            "md = tf.compat.v1.RunMetadata()\nwith tf.compat.v1.Session(graph=g) as s:\n"
            "    s.run(y, {x: [[1.0] * 64] * 64}, options=memory.traced(), run_metadata=md)\n"
            "print(sum(memory.step_peaks(md).values()))\n")
    env = {k: v for k, v in os.environ.items() if k != "TF_CPP_MIN_LOG_LEVEL"}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0 and int(done.stdout.split()[-1]) >= 64 * 64 * 4, done.stderr
    assert "GPU trace was not collected" not in done.stderr
