"""Communication: the collective operations passes ask for, lowered once per
backend.

collectives.py defines the operations and TensorFlow's lowering (collective
ops, server sums by queues); horovod.py is Horovod's; lowering.py picks the
plan's; keys.py hands out collective instance keys.

May import: parallax_ng.graph and the foundation (errors, compat).
"""
