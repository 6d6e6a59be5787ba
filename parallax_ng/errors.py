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
