"""Tools: the `parallax-ng` command (cli.py), the launcher of local jobs
(launch.py) and the graph diff (diff.py).

May import: everything; nothing in the library imports tools.
"""
