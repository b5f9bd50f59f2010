"""The node around a worker: what tells it to stop, and what keeps its machine from a scale-in.

``stop`` (a stop request and its deadline), ``reclaim`` (spot notices from the clouds' metadata
services; the instance's region), ``protection`` (scale-in marks: the instance's protection, the
pod's deletion cost), ``board`` (what a node's workers and their supervisor tell each other),
``policy`` and ``supervisor`` (a node of several GPUs: one worker per GPU, restarted or retired).

May import: nothing else of worker.
"""
