"""Stands in for matplotlib in the processes the tests start (task_env.py):
importing it fails, as where matplotlib is not installed."""
raise ImportError("matplotlib is left out of the processes the tests start (tests/task_env.py)")
