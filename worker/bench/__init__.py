"""``renderfleet bench``: images per second and cost per image on this card.

``run`` (a sweep of batch sizes, the knee, ``--compare`` of several cards' runs), ``stages``
(the same for a job's stages: upscale, refine).

May import: worker.render, worker.accounting, worker.node.
"""
