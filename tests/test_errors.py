"""Errors: what parallax_ng adds to an error TensorFlow's message alone
leaves unexplained."""
import tensorflow as tf

from parallax_ng.errors import REFUSED_WHY, explained

# the words a server's worker service answers a repeated RunGraph request with
REFUSED = ("From /job:ps/replica:0/task:0:\nThe same RunGraph (Worker) request was received "
           "twice. goo.gle/debugstr  graph_handle: \"0000000000000002\" step_id: "
           "21329820414205678 request_id: 2355199325261604975")


def test_a_run_a_server_refused_as_a_repeat_says_why_and_what_to_do():
    told = explained(tf.errors.AbortedError(None, None, REFUSED))
    assert isinstance(told, tf.errors.AbortedError)   # still one a job restarts for
    assert told.message == REFUSED_WHY + REFUSED
    first = str(told).splitlines()[0]        # the launcher shows a task's first line
    assert "refused this run as a repeat" in first and "--restarts" in first


def test_every_other_error_is_left_as_it_is():
    for error in (tf.errors.AbortedError(None, None, "Step was aborted by a peer"),
                  tf.errors.UnavailableError(None, None, REFUSED),
                  ValueError(REFUSED)):
        assert explained(error) is error
