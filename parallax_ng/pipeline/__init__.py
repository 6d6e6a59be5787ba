"""The pass pipeline: the contract of a pass, the context passes share and
the manager that orders, runs, verifies, times and dumps them
(passes.py), and the typed results passes publish for later passes and
the runtime (results.py, step_parts.py). The passes themselves are the
top-level package `transforms`.

May import: parallax_ng.planning, .comm, .graph and the foundation.
"""
