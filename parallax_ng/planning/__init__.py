"""Planning: what to do with every variable, decided before any rewrite.

analysis.py measures each variable (dense or sparse, bytes, rows a step
touches); column_cut.py, deferral.py and coalescing.py say what the graph
allows (cut by columns, delayed row updates, coalesced rows); costmodel.py
and traffic.py predict what each method and each whole plan costs on the
job's links, choice.py picks among whole plans, buckets.py packs
all-reduces; profile.py and costfit.py are the measurements the planner
takes from the job; planner.py makes the Plan (plan.py, placement.py),
plain data every later layer reads.

May import: parallax_ng.graph, parallax_ng.comm and the foundation.
"""
