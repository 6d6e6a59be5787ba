"""Errors raised by parallax_ng. Each names the problem and what is accepted."""


class ParallaxError(Exception):
    """Base class of every error parallax_ng raises on purpose."""


class ConfigError(ParallaxError, ValueError):
    """A config key or value is not understood."""


class ResourceError(ParallaxError, ValueError):
    """The resource description names no usable devices or hosts."""


class GraphError(ParallaxError, ValueError):
    """The user's graph cannot be parallelized as it is (names the node/op)."""


class FetchError(ParallaxError, KeyError):
    """A fetch or feed names nothing in the user's graph."""

    def __str__(self):  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class UnevenFeed(FetchError):
    """A batch fed whose rows do not split evenly over the replicas."""


REFUSED = "request was received twice"     # TensorFlow's words for a refused RunGraph
REFUSED_SAID = "refused this run as a repeat of an earlier request"    # parallax_ng's words
REFUSED_WHY = (
    f"a task of the job {REFUSED_SAID}, which "
    "TensorFlow's distributed runtime does now and then in a long job: its request ids "
    "take about 2**32 values and a task refuses any of the last 100,000 it took, so "
    "about one run in 43,000 once it holds them (docs/limits.md). Train such jobs with a "
    "checkpoint.dir and `parallax-ng run --restarts N`, which resume from the last "
    "checkpoint. TensorFlow said: ")


def explained(error: BaseException) -> BaseException:
    """`error` with what it means and what to do first where TensorFlow's
    message alone would not say (a run a server refused as a repeated
    request: a new AbortedError, still one the launcher restarts a job
    for); any other error as it is."""
    import tensorflow as tf
    if not isinstance(error, tf.errors.AbortedError) or REFUSED not in error.message:
        return error
    return tf.errors.AbortedError(error.node_def, error.op, REFUSED_WHY + error.message)
