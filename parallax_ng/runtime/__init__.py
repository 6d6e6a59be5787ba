"""Runtime: driving a transformed graph.

runner.py is the Runner the user gets (fetches and feeds mapped by
fetches.py, session runs by executor.py, checkpoints by checkpoint.py,
device memory by memory.py); serving.py is what a job's parameter servers
do and how workers share worker 0's measurements; heartbeat.py is what a
launched task tells its launcher; preemption.py is what SIGTERM does.

May import: parallax_ng.pipeline, .planning, .comm, .graph and the
foundation.
"""
