"""Random streams per replica.

A replicated graph copies every random op with its `seed`/`seed2` attrs, so
seeded ops (an op seed, or any op under a graph seed) would draw the same
numbers on every replica: dropout masks repeating every b rows, noise that
one device with the global batch never has. The plan decides, per stateful
random op, whether replicas draw

- `distinct` streams (the default but for the ops below): replica 0 of the
  job keeps the user's seeds, so it draws what one device draws; replica
  r > 0 draws from `seed2` mixed with r, deterministically (two runs with
  the same seeds draw the same numbers). Ops without seeds (both 0)
  already draw a fresh stream per op instance and stay unseeded;
- `identical` streams: every replica of every worker draws the same
  numbers; an op without seeds gets a fixed seed derived from its name.
  The default (`random: auto`) for the candidate samplers of sampled
  softmax and NCE (`BATCH_FREE`): one device draws `num_sampled`
  negatives once for its whole batch, whatever the batch, so replicas
  that draw them alike (with the user's seeds) compute exactly its step;
  and for draws the step uses only after its gradients (gradient noise).

Requires: a TrainingGraph and the config. Guarantees: `decide` names every
seeded random op of the graph and of its functions (`function/op` for the
latter), and `seeds` gives the attrs of one replica's copy.
Stateless random ops take their seed as a tensor. Where that tensor is the
same on every replica (a constant, or a variable's value: Keras 3's seed
generators, which Dropout and the noise layers draw from), `stateless_draws`
names them and the plan decides them like the stateful ones: under
`distinct`, replica r > 0's copy reads its seed XORed with `seed_mask(r)`
(the first element; the second, Keras's call counter, is left alone), so
replica 0 still draws what one device draws for its rows. A seed computed
from the input (a per-example seed) already differs per replica and is left
alone. A tf.random.Generator's draws read its state through an Identity
(graph/generators.py lowers them so): `stateless_draws` names those too,
and under `distinct` replica r > 0 XORs `key_mask(r)` into the key.
Random ops that feed a queue an input producer fills are pinned to
`identical` elsewhere (their shuffle must agree for the shards to be
disjoint).

A stateful op's stream lives in its kernel: a new process starts it again,
so a job restarted from a checkpoint would draw what its first steps drew.
`counted` names the seeded ones whose draws can be counted instead: the op
becomes its stateless kind (`STATELESS`) keyed by (seed, seed2) and a call
counter kept in a variable (transforms/counted_draws.py), which is
TensorFlow's own Philox stream: the k-th call of a stateful op with n
outputs draws from counter [256 * (outputs of the calls before), seed2]
and key [seed] (each call reserves 256 samples per output). Left stateful:
ops in a while loop's body (tf.compat.v1 loops: one counter read would
serve every iteration), ops that only draw initial values, an input
producer's shuffle (queues hold their elements outside any checkpoint),
and kinds without a stateless twin (RandomShuffle, Multinomial,
RandomGamma, ...). The candidate samplers of sampled softmax and NCE
(`REPLAYED`) have no stateless twin, but every call reserves the same
2048 x num_sampled samples of the stream whatever it draws, and learns
nothing from its input: they stay stateful, a counter counts their calls,
and after a restore each is called that many times again (with placeholder
classes) to put its stream back (runtime/checkpoint.py).
"""
from __future__ import annotations

import re
import zlib

from tensorflow.python.framework import op_def_registry

from ..errors import ConfigError

GENERATOR_READ = "/parallax_generator_state"
STATELESS = {"RandomUniform": "StatelessRandomUniformV2",
             "RandomStandardNormal": "StatelessRandomNormalV2",
             "TruncatedNormal": "StatelessTruncatedNormalV2",
             "RandomUniformInt": "StatelessRandomUniformIntV2"}
SAMPLES_PER_OUTPUT = 256   # what a stateful op's call reserves of its stream per output
REPLAYED = ("LogUniformCandidateSampler", "UniformCandidateSampler",
            "FixedUnigramCandidateSampler")
# what they draw does not depend on the batch (nor on anything they were
# given before): one device draws one set for its whole batch
BATCH_FREE = REPLAYED + ("AllCandidateSampler",)
NOT_RANDOM = ("ComputeAccidentalHits",)   # seed attrs, but nothing drawn

_MASK = (1 << 63) - 1
_FIXED_SEED = 87654321   # TensorFlow's default op seed under a graph seed


def is_random(node_def) -> bool:
    """A stateful random op: one with integer `seed` and `seed2` attrs (data
    pipeline ops take seeds as tensors and are never touched)."""
    return ("seed" in node_def.attr and "seed2" in node_def.attr
            and "Dataset" not in node_def.op and node_def.op not in NOT_RANDOM)


def seed_input(node_def) -> int | None:
    """Input position of a stateless random op's `seed` tensor (None for
    other ops, and for ops whose inputs before it are lists)."""
    if not node_def.op.startswith("Stateless"):
        return None
    op_def = op_def_registry.get(node_def.op)
    names = [a.name for a in op_def.input_arg] if op_def is not None else []
    if "seed" not in names:
        return None
    at = names.index("seed")
    if any(a.number_attr or a.type_list_attr for a in op_def.input_arg[:at]):
        return None
    return at


def stateless_draws(ir, variant) -> list[str]:
    """Stateless random ops (top level) whose seed is the same on every
    replica (its producer is not in `variant`), and the states a
    tf.random.Generator's draws read (graph/generators.py)."""
    out = []
    for node in ir.nodes:
        if generator_read(node):
            out.append(node.name)
            continue
        at = seed_input(node)
        if at is not None and ir.data_inputs(node.name)[at].node not in variant:
            out.append(node.name)
    return out


def generator_read(node) -> bool:
    """Whether NodeDef `node` is the state a tf.random.Generator's draw
    reads, as graph/generators.py lowers it (an Identity of its read)."""
    return node.op == "Identity" and bool(node.input) and \
        node.input[0] == node.name + GENERATOR_READ


def key_mask(replica: int, size: int) -> list[int]:
    """What replica `replica` (> 0) XORs into a generator's state of `size`
    words (graph/generators.py): the key, its last word."""
    return [0] * (size - 1) + [seed_mask(replica)]


def seed_mask(replica: int) -> int:
    """What job replica `replica` (> 0) XORs into a stateless op's first seed
    element: a nonzero value below 2**31, so int32 seeds keep their type."""
    return (_mix(0x5EED, replica) & 0x7FFFFFFF) or 1


def counted(tg, random, pinned=frozenset()) -> list[str]:
    """The top-level ops among `random` (plan key -> mode) whose calls a
    counter can stand for (module docstring), in graph order: seeded, or
    given a seed by `identical`."""
    ir = tg.ir
    loops = in_loops(ir)
    inits = [v.initializer for v in tg.variables.values() if v.initializer]
    setup = ir.ancestors(inits)
    return [n.name for n in ir.nodes
            if n.name in random and (n.op in STATELESS or n.op in REPLAYED) and is_random(n)
            and (any(_attrs(n)) or random[n.name] == "identical")
            and n.name not in loops and n.name not in pinned
            and _beyond(ir, n.name, setup)]


def _beyond(ir, name: str, setup: set) -> bool:
    """Whether `name` reaches more than the initializers `setup` holds (and
    the NoOps that group them, such as global_variables_initializer's)."""
    return any(ir.node(d).op != "NoOp" for d in ir.descendants([name]) - setup)


def in_loops(ir) -> set[str]:
    """Nodes inside a tf.compat.v1 while loop's frame: reached from an Enter
    with more Enters than Exits on the way."""
    todo = [(n.name, 1) for n in ir.nodes if n.op in ("Enter", "RefEnter")]
    seen, out = set(), set()
    while todo:
        name, depth = todo.pop()
        if (name, depth) in seen or depth > 64:
            continue
        seen.add((name, depth))
        out.add(name)
        for c in ir.node_consumers.get(name, ()):
            op = ir.node(c).op
            d = depth + 1 if op in ("Enter", "RefEnter") else \
                depth - 1 if op in ("Exit", "RefExit") else depth
            if op in ("Exit", "RefExit"):
                out.add(c)
            if d > 0:
                todo.append((c, d))
    return out


def random_ops(nodes, library) -> dict[str, tuple[int, int]]:
    """(seed, seed2) of every random op among `nodes` and in the function
    library: top-level by name, function bodies as `function/op`."""
    out = {n.name: _attrs(n) for n in nodes if is_random(n)}
    for f in (library.function if library is not None else ()):
        for n in f.node_def:
            if is_random(n):
                out[f"{f.signature.name}/{n.name}"] = _attrs(n)
    return out


def batch_free(tg, drawn) -> set[str]:
    """The random ops (names as `random_ops` gives them) whose draws do not
    depend on the batch: the candidate samplers of sampled softmax and NCE
    (`BATCH_FREE`; not the learned-unigram ones, which learn from the
    classes they are given), and draws the step uses only after its
    gradients (noise added to a gradient: one device draws it once for the
    global batch, so every replica applies the same update)."""
    library, grads = tg.ir.library, {r.node for r in tg.gradient_tensors}
    before = tg.ir.ancestors(grads) if grads else set()     # the forward and backward passes
    out = {n.name for n in tg.ir.nodes if n.op in BATCH_FREE}
    out.update(n for n in drawn if n in tg.ir and n not in before and
               tg.ir.descendants({n}) & tg.after_gradients)     # (`drawn`: random_ops' and
    for f in (library.function if library is not None else ()):    # stateless_draws')
        out.update(f"{f.signature.name}/{n.name}" for n in f.node_def if n.op in BATCH_FREE)
    return out


def decide(ops: dict[str, tuple[int, int]], default: str,
           overrides: dict[str, str], pinned=frozenset(),
           batch_free=frozenset()) -> dict[str, str]:
    """Mode of every random op: identical for `pinned` ops (an input
    producer's shuffle), else the first override whose regex it matches
    (re.search), else `default`; `auto` is identical for the `batch_free`
    ops (replicas draw what one device draws once for the global batch) and
    distinct for the rest. A pattern that matches no op is an error."""
    patterns = {}
    for pattern in overrides:
        try:
            patterns[pattern] = re.compile(pattern)
        except re.error as e:
            raise ConfigError(f"config key 'random_ops.{pattern}' is not a regular "
                              f"expression: {e}") from None
        if not any(patterns[pattern].search(name) for name in ops):
            raise ConfigError(
                f"config key 'random_ops.{pattern}' matches no random op of the graph; "
                f"its seeded random ops: {sorted(ops)[:8] or 'none'}")
    out = {}
    for name in ops:
        mode = next((overrides[p] for p, rx in patterns.items() if rx.search(name)), default)
        if mode == "auto":
            mode = "identical" if name in batch_free else "distinct"
        out[name] = "identical" if name in pinned else mode
    return out


def seeds(name: str, mode: str, seed: int, seed2: int, replica: int) -> tuple[int, int]:
    """The (seed, seed2) attrs of job-wide replica `replica`'s copy of op `name`."""
    if mode == "identical":
        if seed or seed2:
            return seed, seed2
        return _FIXED_SEED, 1 + zlib.crc32(name.encode())
    if replica == 0 or not (seed or seed2):
        return seed, seed2
    return seed, _mix(seed2, replica)


def _mix(seed2: int, replica: int) -> int:
    """A 63-bit value from (seed2, replica) with splitmix64's finaliser, never 0."""
    z = (seed2 * 0x9E3779B97F4A7C15 + replica * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return ((z ^ (z >> 31)) & _MASK) or 1


def repeatable(node_def, mode: str) -> bool:
    """Whether a random op draws the same numbers in every run (seeded, or
    given a seed by `identical`): a new session must not start it again."""
    return any(_attrs(node_def)) or mode == "identical"


def _attrs(node_def) -> tuple[int, int]:
    return node_def.attr["seed"].i, node_def.attr["seed2"].i
