"""The batch's axis through loops, calls and lists: a while loop's
variables (TensorFlow's v1 frames, and functional While ops), a called
function's results and an If's, and the elements of TensorArrays and
TensorLists (a recurrent layer's time steps). A base of graph/rows.py's
reading, which supplies `axis`, `elements`, `rows`, `memo`, `bound`,
`graph` and `root`.

Requires: tf.Tensors of a graph (and of its functions' bodies).
Guarantees: reads the graph only; None where a loop's body does not keep
the axis its variable enters with, or a cond's branches disagree.
"""
from __future__ import annotations

from .. import compat

# ops whose output is their input (the forms of loops and control flow included)
PASS = {"Identity", "Snapshot", "Enter", "RefEnter", "Exit", "RefExit", "NextIteration",
         "RefNextIteration", "Switch", "RefSwitch", "EnsureShape", "CheckNumerics",
         "CheckNumericsV2", "StopGradient", "PreventGradient", "IdentityN"}

_CALLS = {"While": "body", "StatelessWhile": "body", "PartitionedCall": "f",
          "StatefulPartitionedCall": "f"}
_BRANCHES = {"If", "StatelessIf"}


class Flow:
    """The control-flow half of a reading of a graph (rows.py's _Axes)."""

    def _elements(self, t):
        op, kind = t.op, t.op.type
        if op.name in self.bound:
            caller, outer = self.bound[op.name]
            return caller.elements(outer)
        if kind in PASS:
            return self.elements(op.inputs[t.value_index if kind == "IdentityN" else 0])
        if kind in ("Merge", "RefMerge"):
            return self._merged(t, "elements")
        if kind in ("TensorListSetItem", "TensorListPushBack"):
            a = self.axis(op.inputs[2 if kind == "TensorListSetItem" else 1])
            return a if a is not None else self.elements(op.inputs[0])
        if kind in ("TensorListFromTensor", "TensorListScatter", "TensorListScatterV2",
                    "TensorListScatterIntoExistingList"):
            a = self.axis(op.inputs[1 if kind == "TensorListScatterIntoExistingList" else 0])
            return a - 1 if a else None
        if kind == "TensorArrayV3":
            return self._written(t)
        return self._called(op, t, "elements")

    def _written(self, handle):
        """The axis of the elements a TensorArray's writes and scatters give
        it, wherever they are (a loop's body reaches the handle through Enter)."""
        stack, seen = [handle], set()
        while stack:
            h = stack.pop()
            for op in h.consumers():
                if op.name in seen:
                    continue
                seen.add(op.name)
                if op.type in ("Enter", "RefEnter", "Identity", "Switch", "RefSwitch"):
                    stack.extend(op.outputs)
                elif op.type == "TensorArrayWriteV3" and self.axis(op.inputs[2]) is not None:
                    return self.axis(op.inputs[2])
                elif op.type == "TensorArrayScatterV3" and self.axis(op.inputs[2]):
                    return self.axis(op.inputs[2]) - 1
        return None

    def _called(self, op, t, read: str):
        """`read` ("axis" or "elements") of output `t` of a functional op: a
        While's loop variable, a call's result, an If whose branches agree."""
        kind = op.type
        if kind in _BRANCHES:
            answers = {self._in_body(op, op.get_attr(b).name, op.inputs[1:], t, read)
                       for b in ("then_branch", "else_branch")}
            return answers.pop() if len(answers) == 1 else None
        if kind in _CALLS:
            inner = self._in_body(op, op.get_attr(_CALLS[kind]).name, op.inputs, t, read)
            if not kind.endswith("While"):
                return inner
            known = {inner, getattr(self, read)(op.inputs[t.value_index])} - {None}
            return known.pop() if len(known) == 1 else None     # the body keeps it
        if self.graph._is_function(kind):   # noqa: SLF001 (a function called by its name)
            return self._in_body(op, kind, op.inputs, t, read)
        return None

    def _in_body(self, op, name, inputs, t, read):
        inner = self._body(op, name, inputs)
        if inner is None or t.value_index >= len(inner.graph.outputs):
            return None
        return getattr(inner, read)(inner.graph.outputs[t.value_index])

    def _body(self, op, name, inputs):
        """The reading of function `name`'s body, its inputs bound to `inputs`."""
        body = compat.function_graph(self.graph, name) or compat.function_graph(self.root, name)
        if body is None or len(body.inputs) != len(inputs):
            return None
        key = ("body", op.name, name)
        if key not in self.memo:
            self.memo[key] = type(self)((), body, {p.op.name: (self, x) for p, x in
                                                   zip(body.inputs, inputs)}, self.root)
        return self.memo[key]

    def bodies(self, op) -> list:
        """The readings of the bodies functional op `op` runs (a While's body,
        an If's branches, a called function), their inputs bound to its."""
        if op.type in _BRANCHES:
            names, inputs = [op.get_attr(b).name for b in ("then_branch", "else_branch")], \
                op.inputs[1:]
        elif op.type in _CALLS:
            names, inputs = [op.get_attr(_CALLS[op.type]).name], op.inputs
        else:
            return []
        return [r for r in (self._body(op, name, inputs) for name in names) if r is not None]

    def _merged(self, t, read: str):
        """`read` of a Merge: a cond's result (its branches must agree) or a
        loop's variable. The value entering the loop gives the answer,
        assumed while the body is read; the value the body passes back must
        keep it, else there is none (and what was read under the assumption
        is read again). A list entering empty takes the body's answer."""
        fn, key = getattr(self, read), (read, t.name)
        ins = list(t.op.inputs)
        back = [x for x in ins if x.op.type in ("NextIteration", "RefNextIteration")]
        known = {fn(x) for x in ins if x.op.type not in ("NextIteration", "RefNextIteration")}
        known -= {None}
        if len(known) > 1:
            return None
        guess = known.pop() if known else None
        before, self.memo[key] = set(self.memo), guess
        passed = set(map(fn, back)) - {None}
        if guess is None:
            return passed.pop() if len(passed) == 1 else None
        if passed <= {guess}:
            return guess
        for stale in set(self.memo) - before:
            del self.memo[stale]
        return None
