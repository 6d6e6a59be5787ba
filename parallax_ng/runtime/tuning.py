"""Tuning: the plan (`tuning.plans`: among the planner's fastest
predictions, planning/choice.py), all-reduce bucket and fusion-buffer sizes
chosen by timing training steps (`buckets.mode: auto`,
`fusion.buffer_bytes: auto`).

Requires: `plan_of(config, profile)` and `program_of(plan)`, which build
the plan and Program of a config (parallax_ng/build.py), and a Runner that
moves its state to another Program (runner.py `_move_to`).
Guarantees: once the profiled steps are done, the Runner trains
`tuning.warmup` + `tuning.steps` steps with each candidate size in turn,
in two passes (the second backwards, so a drift in the machine's speed
weighs on every size alike, and only over the sizes within CONTENDERS of
the first pass's fastest and the size the round began with; fusion
buffers first, then buckets; sizes from the knob's whole gradient down
to a 32nd of it, and one bucket per variable; sizes that pack the
gradients alike are tried once; the plan first, its candidates the
`tuning.plans` predicted fastest, both with and without the servers'
work (`ranked`; auto, the default: AUTO_PLANS where the
planner weighed several, `settled`), each built from a config naming
every variable's method) and goes on with the contender whose
timed steps of both passes had the smallest median, if that is
`tuning.margin` below the median of the size the round began with (the
default, or the size chosen before a drift) over both passes and in
each; else with that size. Steps of one size swing by 10-30% on a busy
host, and a move costs a second or two (a graph built, the state
carried; docs/benchmarks.md), so a near tie keeps what training has. Every
size is the same math (exact, as every plan), so the trials are training
steps, none is lost; only the order in which a bucket's elements are
summed changes, within float rounding. In a job every worker moves at
the same step (the schedule counts training steps) and takes worker 0's
choice (`decide`: runtime/serving.py share). With `tuning.drift` > 0, the
median of each `tuning.window` steps after the choice is compared with the chosen size's
(worker 0's, given to all) and, once it is that fraction slower, the
sizes are tried again. What was tried and chosen is printed once per
round by worker 0 and kept in `tuned`.
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace

from ..methods import method
from ..planning.choice import DENSE

KNOBS = ("plan", "fusion.buffer_bytes", "buckets.bytes")
FRACTIONS = (1, 2, 4, 8, 16, 32)      # sizes tried: the knob's whole gradient over these
CONTENDERS = 1.15     # the second pass tries the sizes within this of the first's fastest


AUTO_PLANS = 3     # plans timed where `tuning.plans` is auto and the planner weighed more


def knobs(config) -> list[str]:
    """What `config` asks to tune: the plan (`tuning.plans` > 1; auto is
    `settled` first), then sizes."""
    plans = config.tuning.plans
    return [k for k, auto in zip(KNOBS, (plans != "auto" and plans > 1,
                                         config.fusion.buffer_bytes == "auto",
                                         config.buckets.mode == "auto")) if auto]


def settled(config, plan):
    """`config` with `tuning.plans` a number: auto times AUTO_PLANS of the
    plans `plan`'s planner weighed (a job's hybrid or auto, with servers or
    kernels by their factors: planning/choice.py), or none but the
    prediction where it weighed one."""
    if config.tuning.plans != "auto":
        return config
    plans = AUTO_PLANS if len(plan.choice) > 1 else 1
    return replace(config, tuning=replace(config.tuning, plans=plans))


def asked(config) -> str:
    """The config keys that ask for tuning, as the user wrote them (auto
    plans are not asked for)."""
    return " and ".join({"plan": f"tuning.plans {config.tuning.plans}",
                         "fusion.buffer_bytes": "fusion.buffer_bytes auto",
                         "buckets.bytes": "buckets.mode auto"}[k] for k in knobs(config))


def configured(config, knob: str, size):
    """`config` with `knob` fixed at `size` bytes, or (knob "plan") at the
    methods of a candidate plan, `size` a Candidate."""
    if knob == "plan":
        return forced(config, dict(size.methods))
    if knob == "buckets.bytes":
        return replace(config, buckets=replace(config.buckets, mode="threshold", bytes=size))
    return replace(config, fusion=replace(config.fusion, buffer_bytes=size))


def forced(config, methods: dict):
    """`config` naming every variable's method as `methods` has it, so the
    planner builds that plan without weighing others (its dense method the
    one most dense variables take: the planner reads it only in messages)."""
    dense = [m for m in methods.values() if m in DENSE]
    return replace(config, variable_methods={**methods, **config.variable_methods},
                   dense_method=max(DENSE, key=dense.count) if dense else "allreduce")


def ranked(plan, count: int) -> list:
    """The `count` candidates of `plan`'s choice (choice.py) predicted
    fastest, the chosen first; where those all give the servers work, or
    none does, the last of them is the fastest of the other kind instead.
    (The links' model leaves out the servers' CPU: where tasks share
    cores it measured plans with servers 2-4x their predicted time and the
    ring without them 1.6x, docs/benchmarks.md, so both kinds are timed.)"""
    order = sorted(plan.choice, key=lambda c: (not c.chosen, c.seconds))
    top = order[:count]
    kinds = {serves(c) for c in top}
    other = [c for c in order[count:] if serves(c) not in kinds]
    if count > 1 and len(kinds) == 1 and other:
        top = top[:-1] + other[:1]
    return top


def serves(candidate) -> bool:
    """Whether a candidate's plan gives the parameter servers work."""
    return any(method(m).shared or method(m).servers for _, m in candidate.methods)


def packing(plan, knob: str) -> tuple:
    """What `knob` decides in `plan`: its buckets' variables, or its buffers'
    segments; a plan's, every variable's method."""
    if knob == "plan":
        return plan.methods()
    if knob == "buckets.bytes":
        return tuple(b.variables for b in plan.buckets)
    return tuple(b.segments for b in plan.buffers)


def now_bytes(plan, knob: str) -> int:
    """The bytes `knob` packs in `plan`."""
    if knob == "buckets.bytes":
        return sum(plan.variables[v].info.nbytes for b in plan.buckets for v in b.variables)
    return sum(plan.bytes_of(b) for b in plan.buffers)


def sizes(total: int, knob: str) -> list[int]:
    """The sizes tried for `total` bytes: the whole down to a 32nd, and
    (buckets) 1 byte: one all-reduce per variable."""
    out = [max(1, total // k) for k in FRACTIONS]
    return out + [1] if knob == "buckets.bytes" else out


def trials(plan_of, base, now, knob: str) -> list[tuple[int, object]]:
    """The sizes of `knob` tried besides `now`'s (the plan of `base`), each
    with its plan (`plan_of(config)`): one per packing not seen before."""
    seen, out = {packing(now, knob)}, []
    for size in sizes(now_bytes(now, knob), knob) if now_bytes(now, knob) else ():
        plan = plan_of(configured(base, knob, size))
        if packing(plan, knob) not in seen:
            seen.add(packing(plan, knob))
            out.append((size, plan))
    return out


def candidates(plan_of, config) -> dict[str, list[tuple[int, int]]]:
    """For `parallax-ng plan`: {knob: [(size, buckets or buffers it makes)]}
    for each knob `config` tunes, the sizes training will try (the first
    the graph's to begin with); for the plan, [(label, 1)]."""
    out, now = {}, plan_of(config)
    for knob in knobs(config):
        if knob == "plan":
            out[knob] = [(c.label, 1) for c in ranked(now, config.tuning.plans)]
            continue
        tried = [(_size_of(config, knob), now)] + trials(plan_of, config, now, knob)
        out[knob] = [(size, len(packing(plan, knob))) for size, plan in tried]
    return out


def named(knob: str, size, count: int) -> str:
    """`size` of `knob` as printed: its bytes (or the default) and what it
    makes; a plan, its label."""
    if knob == "plan":
        return f"'{size}'"
    what = "bucket" if knob == "buckets.bytes" else "buffer"
    return ("the default" if size in ("auto", 0) else f"{size:,} bytes") + \
        f" ({count} {what}{'s' * (count != 1)})"


class Tuner:
    """Times training steps of each candidate size and picks the fastest;
    `trained(seconds, profile)` after each training run returns the
    Program to move to, or None."""

    def __init__(self, config, plan_of, program_of, decide, worker: int, asked: str = ""):
        self.config, self.settings = config, config.tuning
        self.asked = asked                # what the user asked for ("": tuning.plans auto)
        self._plan_of, self._program_of = plan_of, program_of
        self._decide, self._worker = decide, worker
        self.tuned: dict[str, dict] = {}
        self._rounds = knobs(config)      # knobs left to tune, in turn
        self._fixed: dict[str, int] = {}  # knob -> size chosen
        self._knob = None                 # the knob being tried
        self._trial: list[tuple[int, object]] = []   # (size, plan) still to try
        self._second: list[tuple[int, object]] = []  # the first pass's, for the second
        self._kept: list = []             # the sizes in the second pass
        self._size, self._times = None, []
        self._timed: dict = {}            # size -> its timed steps, a list per pass
        self._last = None                 # the chosen size's median step
        self._watch = None                # after the rounds: (median to keep, steps since)
        self._graphs = 0                  # graphs built
        self._began = 0.0                 # when the round began
        self._counts: dict = {}           # size -> buckets or buffers it makes
        self._first = None                # the size (plan label) the round began with
        self._plans: dict = {}            # plan label -> its Candidate

    def trained(self, seconds: float, profile):
        """After a training run of `seconds`: the Program of the size to
        train with from the next step on, or None to go on."""
        if self._knob is None:
            return self._start(profile) if self._watch is None else \
                self._drifted(seconds, profile)
        self._times.append(seconds)
        if len(self._times) < self.settings.warmup + self.settings.steps:
            return None
        self._timed.setdefault(self._size, []).append(self._times[self.settings.warmup:])
        self._times = []
        if not self._trial and self._second:
            self._trial, self._second = self._contenders(self._second), []
        if self._trial:     # a size tried twice in a row is built again: every
            self._size, plan = self._trial.pop(0)          # trial starts alike
            return self._build(plan)
        return self._choose(profile)

    def may_move_plan(self) -> bool:
        """Whether training may still move to another plan (one that puts
        work on the servers, say): a plan round is due or under way, or
        drift may start one again."""
        return "plan" in self._rounds or self._knob == "plan" or (
            "plan" in self._fixed and self.settings.drift > 0)

    def _contenders(self, tried):
        """The second pass: the first pass's sizes, backwards, whose median
        was within CONTENDERS of the fastest's, and the size the round began
        with, which the margin compares with in each pass (worker 0's, for
        every worker)."""
        medians, first = _medians(self._timed), self._first
        mine = [s for s, _ in tried if s == first or
                medians[s] <= CONTENDERS * min(medians.values())] if self._worker == 0 else None
        self._kept = self._decide(mine)
        return [(s, plan) for s, plan in reversed(tried) if s in self._kept]

    def _build(self, plan):
        """The Program of `plan`, its collectives keyed apart from every
        graph before it."""
        self._graphs += 1
        return self._program_of(plan, self._graphs)

    def _base(self, but: str | None = None):
        """The config with the plan and sizes chosen so far (`but` that knob's)."""
        config = self.config
        for knob, size in self._fixed.items():
            if knob != but:
                config = configured(config, knob, self._plans[size] if knob == "plan" else size)
        return config

    def _round(self, knob: str, profile):
        """(the size or plan label training has, its plan, the others to try
        with their plans)."""
        base = self._base()
        now = self._plan_of(base, profile)
        if knob != "plan":
            return _size_of(base, knob), now, trials(
                lambda c: self._plan_of(c, profile), base, now, knob)
        free = self._base(but="plan")
        weighed = now if "plan" not in self._fixed else self._plan_of(free, profile)
        tried = ranked(weighed, self.settings.plans)
        self._plans.update((c.label, c) for c in tried)
        first = self._fixed.get("plan", tried[0].label if tried else None)
        return first, now, [(c.label, self._plan_of(configured(free, knob, c), profile))
                            for c in tried if c.label != first]

    def _start(self, profile):
        """Begin the next knob's round; its first candidate is the size the
        graph has now (no move). After the last, watch for drift."""
        while self._rounds:
            knob = self._rounds.pop(0)
            first, now, trial = self._round(knob, profile)
            if trial:       # two passes, the second backwards: a drift hits all alike
                self._size = self._first = first
                self._times, self._timed = [], {}
                self._began = time.monotonic()
                self._knob = knob
                self._trial, self._second = list(trial), [(self._size, now)] + trial
                self._counts.update((size, len(packing(plan, knob)))
                                    for size, plan in [(first, now)] + trial)
                return None
        drift = self.settings.drift > 0 and self._last is not None
        self._watch = (self._last if drift else None, [])
        return None

    def _choose(self, profile):
        """Worker 0's fastest size, for every worker; the Program to move to
        unless the graph has it already."""
        knob, tried = self._knob, _medians(self._timed)
        mine = None
        if self._worker == 0:
            mine, first = min(self._kept, key=lambda s: tried[s]), self._first
            if not self._faster(mine, first, tried):
                mine = first          # within the margin: keep what training began with
        best = self._decide(mine)
        self._fixed[knob], self._last = best, tried.get(best)
        self.tuned[knob] = {"chosen": best, "tried": dict(tried)}
        if self._worker == 0:
            listed = ", ".join(f"{named(knob, s, self._counts.get(s, 0))}: {t * 1e3:.1f} ms"
                               for s, t in tried.items())
            fastest = min(tried, key=tried.get)
            kept = "" if fastest == best else (
                f"; kept, as {named(knob, fastest, self._counts.get(fastest, 0))} was not "
                f"{self.settings.margin:.0%} faster")
            print(f"parallax_ng: tuned {knob} = {named(knob, best, self._counts.get(best, 0))}"
                  f" (median step {tried[best] * 1e3:.1f} ms{kept}; tried {listed}; in "
                  f"{time.monotonic() - self._began:.1f} s)", file=sys.stderr, flush=True)
        moved = None
        if best != self._size:
            moved = self._build(self._plan_of(self._base(), profile))
        self._knob = None
        self._start(profile)
        return moved

    def _faster(self, size, first, pooled: dict) -> bool:
        """Whether `size` beat `first` by the margin over all its timed steps
        (`pooled`: size -> median) and in each pass that timed both: noise
        that slows one stretch of the round (one pass's trial of `first`)
        does not move training."""
        keep, passes = 1 - self.settings.margin, zip(self._timed[size], self._timed[first])
        return pooled[size] <= pooled[first] * keep and all(
            statistics.median(a) <= statistics.median(b) * keep for a, b in passes)

    def _drifted(self, seconds: float, profile):
        """After the rounds: every `window` steps, whether their median grew
        by more than `drift` over the chosen size's (worker 0 decides, every
        worker follows); if so, every knob is tried again."""
        keep, times = self._watch
        if keep is None:
            return None
        times.append(seconds)
        if len(times) < self.settings.window:
            return None
        median = statistics.median(times)
        again = self._decide(median > keep * (1 + self.settings.drift)
                             if self._worker == 0 else None)
        self._watch = (keep, [])
        if not again:
            return None
        if self._worker == 0:
            print(f"parallax_ng: steps take {median * 1e3:.1f} ms, over "
                  f"{1 + self.settings.drift:g}x the {keep * 1e3:.1f} ms tuned for: trying "
                  "the sizes again", file=sys.stderr, flush=True)
        self._rounds, self._watch = list(self._fixed), None
        return self._start(profile)


def _medians(timed: dict) -> dict:
    """size -> the median of its timed steps over every pass."""
    return {s: statistics.median([t for one in passes for t in one])
            for s, passes in timed.items()}


def _size_of(config, knob: str):
    """The size `knob` has in `config` (its default before tuning)."""
    if knob == "buckets.bytes":
        return config.buckets.bytes
    return config.fusion.buffer_bytes


def usable(tuner: Tuner | None, why_not, worker: int) -> Tuner | None:
    """`tuner`, or None (worker 0 says why) when the Runner cannot move its
    state to another graph: `why_not(jobs=True)` gives the reason."""
    if tuner is None:
        return None
    why = why_not(jobs=True)
    if why is None:
        return tuner
    if worker == 0 and tuner.asked:        # auto plans: the prediction trains, silently
        import warnings
        warnings.warn(f"{tuner.asked}: plans and sizes are not tried while "
                      f"training ({why}); the predicted plan and default sizes train",
                      stacklevel=4)
    return None
