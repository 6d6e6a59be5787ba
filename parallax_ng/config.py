"""Config: the user's choices, validated; from a YAML path, a dict or a Config.

Unknown keys and bad values raise ConfigError naming the key and what is
accepted.
"""
from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass, field

import yaml

from . import methods
from .errors import ConfigError

RUN_OPTIONS = ("hybrid", "allreduce", "ps", "auto")
METHODS = tuple(methods.METHODS)
DENSE_METHODS = ("auto",) + methods.taking(sparse=False)
SPARSE_METHODS = ("auto",) + methods.taking(sparse=True)
PS_PLACEMENTS = ("greedy", "rows_touched", "round_robin")
FETCH_REDUCTIONS = ("mean", "sum", "concat", "first", "max", "min")
VERIFY_LEVELS = ("structure", "full", "import")
BACKENDS = ("tf", "horovod")
COMPRESSIONS = ("none", "fp16", "bf16")
RANDOM_MODES = ("distinct", "identical")
RANDOM_DEFAULTS = ("auto",) + RANDOM_MODES
BATCH_SYNC = ("auto", "always", "never")
BATCH_NORMS = ("per_replica", "synchronized")


@dataclass(frozen=True)
class CommunicationConfig:
    timeout_seconds: float = 300.0   # every runner session.run gives up after this
    backend: str = "tf"              # tf: TensorFlow collectives; horovod: under horovodrun
    compression: str = "none"        # float32 gradients on the wire: none | fp16 | bf16

    def __post_init__(self):
        _check_positive("communication.timeout_seconds", self.timeout_seconds)
        _check_choice("communication.backend", self.backend, BACKENDS)
        _check_choice("communication.compression", self.compression, COMPRESSIONS)


@dataclass(frozen=True)
class CheckpointConfig:
    dir: str | None = None           # where checkpoints go; None: no checkpoints
    every_steps: int = 100           # save after every this many training steps

    def __post_init__(self):
        if self.dir is not None and not isinstance(self.dir, str):
            raise ConfigError(f"config key 'checkpoint.dir' must be a path, not {self.dir!r}")
        if not isinstance(self.every_steps, int) or isinstance(self.every_steps, bool) \
                or self.every_steps < 1:
            raise ConfigError("config key 'checkpoint.every_steps' must be a positive "
                              f"integer, not {self.every_steps!r}")


@dataclass(frozen=True)
class FusionConfig:
    buffer_bytes: int | str = 0      # balanced fusion buffers' size; 0: from model and
                                     # cluster; auto: tuned while training (`tuning`)

    def __post_init__(self):
        if self.buffer_bytes != "auto" and (
                not isinstance(self.buffer_bytes, int) or isinstance(self.buffer_bytes, bool)
                or self.buffer_bytes < 0):
            raise ConfigError("config key 'fusion.buffer_bytes' must be a whole number of "
                              "bytes >= 0 (0: from the model and cluster) or auto (tried "
                              f"while training), not {self.buffer_bytes!r}")


@dataclass(frozen=True)
class TuningConfig:
    """How `buckets.mode: auto` and `fusion.buffer_bytes: auto` try sizes
    while training (parallax_ng/runtime/tuning.py)."""
    steps: int = 30                  # steps timed with each size in each of two passes
    warmup: int = 2                  # steps run first with each size, not timed
    drift: float = 0.0               # try again when the median step grows this much; 0: never
    window: int = 50                 # steps whose median the drift is checked on
    margin: float = 0.03             # another size than the round's first must be this
                                     # much faster (trials are noisy)
    plans: int | str = "auto"        # the planner's fastest predicted plans timed while
                                     # training (hybrid, auto); 1: its prediction trains;
                                     # auto: 3 where the planner weighed several plans
                                     # (runtime/tuning.py settled), else 1

    def __post_init__(self):
        for key, least in (("steps", 1), ("warmup", 0), ("window", 1), ("plans", 1)):
            value = getattr(self, key)
            if key == "plans" and value == "auto":
                continue
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"config key 'tuning.{key}' must be a whole number >= "
                                  f"{least}{' or auto' * (key == 'plans')}, not {value!r}")
        if not isinstance(self.margin, (int, float)) or isinstance(self.margin, bool) \
                or not 0 <= self.margin < 1:
            raise ConfigError("config key 'tuning.margin' must be a number from 0 up to "
                              "below 1 (0.03: another size must be 3% faster than the "
                              "one training has, in both passes; 0: the fastest wins if "
                              f"no pass found it slower), not {self.margin!r}")
        if not isinstance(self.drift, (int, float)) or isinstance(self.drift, bool) \
                or self.drift < 0:
            raise ConfigError("config key 'tuning.drift' must be a number >= 0 (0.25: try "
                              "the sizes again once steps take 25% longer; 0: never), "
                              f"not {self.drift!r}")


@dataclass(frozen=True)
class NetworkConfig:
    """The network `run_option: auto` weighs methods with (None: measured by
    the all-reduce benchmark when the runner profiles, else assumed)."""
    bandwidth: float | None = None   # bytes per second
    latency: float | None = None     # seconds per message

    def __post_init__(self):
        if self.bandwidth is not None:
            _check_positive("network.bandwidth", self.bandwidth)
        if self.latency is not None and (not isinstance(self.latency, (int, float)) or
                                         isinstance(self.latency, bool) or self.latency < 0):
            raise ConfigError(f"config key 'network.latency' must be seconds >= 0, not "
                              f"{self.latency!r}")


BUCKET_MODES = ("none", "single", "threshold", "mgwfbp", "auto")


@dataclass(frozen=True)
class BucketsConfig:
    """All-reduce buckets: dense gradients merged into one all-reduce each."""
    mode: str = ""                   # threshold (the default); none: one per variable;
                                     # single; mgwfbp; auto: thresholds tried while training
    bytes: int = 4 * 2**20           # threshold: a bucket closes once it holds this much
    a: float | None = None           # mgwfbp: seconds per all-reduce (None: measured)
    b: float | None = None           # mgwfbp: seconds per byte all-reduced (None: measured)
    profile: str | None = None       # mgwfbp: a `parallax-ng profile` file to plan from

    def __post_init__(self):
        if not self.mode:            # the default: mgwfbp once a profile exists
            object.__setattr__(self, "mode", "mgwfbp" if self.profile else "threshold")
        _check_choice("buckets.mode", self.mode, BUCKET_MODES)
        if self.profile is not None and not (isinstance(self.profile, str) and
                                             os.path.isfile(self.profile)):
            raise ConfigError(f"config key 'buckets.profile' must name a profile file "
                              f"(parallax-ng profile --out FILE), not {self.profile!r}")
        if not isinstance(self.bytes, int) or isinstance(self.bytes, bool) or self.bytes < 1:
            raise ConfigError("config key 'buckets.bytes' must be a whole number of bytes "
                              f">= 1, not {self.bytes!r}")
        if (self.a is None) != (self.b is None):
            raise ConfigError("config keys 'buckets.a' and 'buckets.b' go together (one "
                              "all-reduce of M bytes costs a + b*M seconds); give both, or "
                              "neither to have them measured")
        for key in ("a", "b"):
            value = getattr(self, key)
            if value is not None and (not isinstance(value, (int, float)) or
                                      isinstance(value, bool) or value < 0):
                raise ConfigError(f"config key 'buckets.{key}' must be a number >= 0, "
                                  f"not {value!r}")


@dataclass(frozen=True)
class PlacementRewritesConfig:
    """Parallax's placement rewrites (paper section 5.3.2), each a pass."""
    local_aggregation: bool = True   # a worker sums its replicas' gradients before they leave it
    colocate_updates: bool = True    # update math that only a server's writers need runs there
    lookups_on_servers: bool = True  # a gather of a whole read of a server variable runs there

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if not isinstance(getattr(self, f.name), bool):
                raise ConfigError(f"config key 'placement_rewrites.{f.name}' must be true or "
                                  f"false, not {getattr(self, f.name)!r}")


REPLAN = ("auto", "always", "never")


@dataclass(frozen=True)
class ProfileConfig:
    steps: int = 1                   # training runs measured (traced) first; 0: none
    replan: str = "auto"             # after them: auto | always | never

    def __post_init__(self):
        if not isinstance(self.steps, int) or isinstance(self.steps, bool) or self.steps < 0:
            raise ConfigError("config key 'profile.steps' must be a whole number >= 0, "
                              f"not {self.steps!r}")
        _check_choice("profile.replan", self.replan, REPLAN)


@dataclass(frozen=True)
class TimelineConfig:
    """A Chrome trace of training steps (parallax_ng/runtime/timeline.py); off
    while `file` is None. `timeline: FILE` is `timeline: {file: FILE}`."""
    file: str | None = None          # where the trace goes
    steps: int = 10                  # training runs traced ...
    skip: int = 2                    # ... after this many (the first ones warm up)

    def __post_init__(self):
        if self.file is not None and not isinstance(self.file, str):
            raise ConfigError(f"config key 'timeline.file' must be a path, not {self.file!r}")
        for key in ("steps", "skip"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(f"config key 'timeline.{key}' must be a whole number >= 0, "
                                  f"not {value!r}")


STASHES = ("device", "host")
PRECISIONS = ("fp32", "cmp")


@dataclass(frozen=True)
class L2LConfig:
    """Layer-to-layer execution (parallax_ng/l2l/builder.py); off while `layers` is None."""
    layers: str | None = None        # regex over variable and op names; group 1: layer index
    micro_batches: int = 1           # parts each replica's batch is split into
    stash: str = "device"            # where layer-boundary activations wait for the backward
    precision: str = "fp32"          # cmp: fp16 on the device, fp32 weights and optimizer
    loss: str | None = None          # the loss tensor's name (None: what tf.gradients took)
    loss_scale: float = 128.0        # cmp: the fp16 backward's loss is scaled by this

    def __post_init__(self):
        if self.layers is not None:
            if not isinstance(self.layers, str):
                raise ConfigError(f"config key 'l2l.layers' must be a regex, not {self.layers!r}")
            try:
                groups = re.compile(self.layers).groups
            except re.error as e:
                raise ConfigError(f"config key 'l2l.layers' is not a regex ({e}): "
                                  f"{self.layers!r}") from None
            if groups < 1:
                raise ConfigError("config key 'l2l.layers' needs a group that captures the "
                                  rf"layer index, e.g. 'encoder/layer_(\d+)/', not {self.layers!r}")
        if not isinstance(self.micro_batches, int) or isinstance(self.micro_batches, bool) \
                or self.micro_batches < 1:
            raise ConfigError("config key 'l2l.micro_batches' must be a positive integer, "
                              f"not {self.micro_batches!r}")
        _check_choice("l2l.stash", self.stash, STASHES)
        _check_choice("l2l.precision", self.precision, PRECISIONS)
        _check_positive("l2l.loss_scale", self.loss_scale)
        if self.loss is not None and not isinstance(self.loss, str):
            raise ConfigError(f"config key 'l2l.loss' must be a tensor name, not {self.loss!r}")

    @property
    def enabled(self) -> bool:
        return self.layers is not None


@dataclass(frozen=True)
class Config:
    run_option: str = "hybrid"
    # mean (true) or sum (false) of the replicas' gradients; auto: by the loss
    # (graph/averaging.py `averages`: summed where the loss sums over the batch)
    average_dense: bool | str = "auto"
    average_sparse: bool | str = "auto"
    communication: CommunicationConfig = field(default_factory=CommunicationConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    timeline: TimelineConfig = field(default_factory=TimelineConfig)
    fusion: FusionConfig = field(default_factory=FusionConfig)
    tuning: TuningConfig = field(default_factory=TuningConfig)
    placement_rewrites: PlacementRewritesConfig = field(
        default_factory=PlacementRewritesConfig)
    buckets: BucketsConfig = field(default_factory=BucketsConfig)
    network: NetworkConfig = field(default_factory=NetworkConfig)
    l2l: L2LConfig = field(default_factory=L2LConfig)
    dense_method: str = "auto"                             # auto: the run option's
    sparse_method: str = "auto"                            # auto: the run option's
    ps_placement: str = "greedy"                           # whole variables over servers
    coalesce_rows: bool = True                             # sum duplicate sparse rows first
    distinct_lookups: bool = True                          # fetch each distinct row once
    prefetch: bool = False                                 # next batch's rows first (alltoall)
    horizontal_scheduling: bool = False                    # dense updates by block, a step later
    variable_methods: dict = field(default_factory=dict)   # variable -> method
    fetch_reduction: dict = field(default_factory=dict)    # tensor name -> how
    batch_feeds: dict = field(default_factory=dict)    # placeholder -> split, whole, axis
    dump_dir: str | None = None                            # graphs after each pass
    verify: str = "structure"
    random: str = "auto"                                   # replicas' random streams
    random_ops: dict = field(default_factory=dict)         # op-name regex -> mode
    batch_sync: str = "auto"                               # fit: the model written per batch
    batch_norm: str = "per_replica"                        # fit: Keras's BatchNormalization's

    def __post_init__(self):
        _check_choice("run_option", self.run_option, RUN_OPTIONS)
        _check_choice("verify", self.verify, VERIFY_LEVELS)
        for key in ("average_dense", "average_sparse"):
            if getattr(self, key) != "auto" and not isinstance(getattr(self, key), bool):
                raise ConfigError(f"config key {key!r} must be true, false or auto, "
                                  f"not {getattr(self, key)!r}")
        for key in ("coalesce_rows", "distinct_lookups", "prefetch", "horizontal_scheduling"):
            if not isinstance(getattr(self, key), bool):
                raise ConfigError(f"config key {key!r} must be true or false, "
                                  f"not {getattr(self, key)!r}")
        for var, method in self.variable_methods.items():
            _check_choice(f"variable_methods.{var}", method, METHODS)
        _check_choice("random", self.random, RANDOM_DEFAULTS)
        _check_choice("dense_method", self.dense_method, DENSE_METHODS)
        _check_choice("sparse_method", self.sparse_method, SPARSE_METHODS)
        _check_choice("ps_placement", self.ps_placement, PS_PLACEMENTS)
        _check_choice("batch_sync", self.batch_sync, BATCH_SYNC)
        _check_choice("batch_norm", self.batch_norm, BATCH_NORMS)
        for pattern, mode in self.random_ops.items():
            _check_choice(f"random_ops.{pattern}", mode, RANDOM_MODES)
        for name, how in self.fetch_reduction.items():
            _check_choice(f"fetch_reduction.{name}", how, FETCH_REDUCTIONS)
        for name, split in self.batch_feeds.items():
            if not isinstance(split, int) or not isinstance(split, bool) and split < 1:
                raise ConfigError(f"config key 'batch_feeds.{name}' must be true (its first "
                                  "dimension is the batch: split it over the replicas), "
                                  "false (every replica gets it whole) or the axis that holds "
                                  f"the batch, 1 or more (1: fed time-major), not {split!r}")

    @classmethod
    def from_dict(cls, data: dict) -> "Config":
        if not isinstance(data, dict):
            raise ConfigError(f"config must be a mapping, not {type(data).__name__}")
        data = dict(data)
        known = {f.name for f in dataclasses.fields(cls)}
        _reject_unknown("", data, known)
        sections = {}
        for key, kind in (("communication", CommunicationConfig),
                          ("checkpoint", CheckpointConfig), ("profile", ProfileConfig),
                          ("fusion", FusionConfig), ("tuning", TuningConfig),
                          ("placement_rewrites", PlacementRewritesConfig),
                          ("buckets", BucketsConfig), ("network", NetworkConfig),
                          ("l2l", L2LConfig), ("timeline", TimelineConfig)):
            section = data.pop(key, None) or {}
            if key == "timeline" and isinstance(section, (str, os.PathLike)):
                section = {"file": os.fspath(section)}
            if not isinstance(section, dict):
                raise ConfigError(f"config key {key!r} must be a mapping")
            _reject_unknown(key + ".", section, {f.name for f in dataclasses.fields(kind)})
            sections[key] = kind(**section)
        for key in ("variable_methods", "fetch_reduction", "random_ops", "batch_feeds"):
            if key in data and not isinstance(data[key], dict):
                raise ConfigError(f"config key {key!r} must be a mapping")
        return cls(**sections, **data)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def load_config(config) -> Config:
    """Accept None, a Config, a dict or a path to a YAML file."""
    if config is None:
        return Config()
    if isinstance(config, Config):
        return config
    if isinstance(config, (str, os.PathLike)):
        return Config.from_dict(read_yaml(os.fspath(config), "config", ConfigError))
    if isinstance(config, dict):
        return Config.from_dict(config)
    raise ConfigError(f"config must be a path, a dict or a parallax_ng.Config, "
                      f"not {type(config).__name__}")


def read_yaml(path: str, what: str, error) -> dict:
    """The mapping a YAML file holds; `error` (naming the `what` file, and
    the line of a syntax error) when it is missing, not YAML or no mapping."""
    if not os.path.exists(path):
        raise error(f"{what} file {path!r} does not exist")
    with open(path) as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            where = getattr(e, "problem_mark", None)
            at = f" at line {where.line + 1}, column {where.column + 1}" if where else ""
            raise error(f"{what} file {path!r} is not valid YAML{at}: "
                        f"{getattr(e, 'problem', None) or e}") from None
    if not isinstance(data, dict):
        raise error(f"{what} file {path!r} holds a {type(data).__name__}, not a mapping "
                    "of keys")
    return data


def _reject_unknown(prefix: str, data: dict, known: set[str]) -> None:
    for key in data:
        if key not in known:
            raise ConfigError(f"unknown config key {prefix + str(key)!r}; "
                              f"known keys: {', '.join(prefix + k for k in sorted(known))}")


def _check_choice(key: str, value, allowed) -> None:
    if value not in allowed:
        raise ConfigError(f"config key {key!r} has value {value!r}; "
                          f"allowed: {', '.join(allowed)}")


def _check_positive(key: str, value) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config key {key!r} must be a positive number, not {value!r}")
