"""The one collection loop: acting, rows, recurrent state, compiled calls, weights, seeds, stats.

It imports the layers below it (``envs/``, ``util/``), never the placements or the public face.
"""
