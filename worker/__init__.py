"""The GPU worker: what runs on a node with a card, one process per GPU.

``main`` wires a worker process from the sub-packages below it; each sub-package's docstring
says what lives there and what it may import (``tests/unit/test_imports.py`` holds them to it):

* ``lease/``: the lease protocol: take a shard, keep its lease, fence, count, give it back.
* ``bench/``: ``renderfleet bench``: sweeps of batch sizes and stages on this card.
* ``render/``: the render path: a shard's batches through the pipeline, its stages, its images.
* ``accounting/``: what the worker measures: GPU time by use, speeds, Prometheus metrics.
* ``node/``: the node around the worker: stop requests, spot notices, scale-in marks, supervisor.

Arrows point down that list (``lease`` and ``bench`` side by side); the contract (``renderfleet``)
is below all of them, and nothing here imports the dispatcher.
"""
