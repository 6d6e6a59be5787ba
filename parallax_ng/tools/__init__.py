"""Tools: the `parallax-ng` command (cli.py), the launcher of jobs
(launch.py, with tasks.py: its view of each process and of the job across
restarts) and the graph diff (diff.py).

May import: everything; nothing in the library imports tools.
"""
