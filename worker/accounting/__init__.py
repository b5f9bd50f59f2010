"""What a worker measures and tells: where its GPU time went, how fast it renders, its metrics.

``gputime`` (wall time by use: kept, lost, loading, compiling, idle), ``speeds`` (measured
seconds per image by card and settings, for estimates and routing; the card's name),
``metrics`` (the worker's Prometheus endpoint).

May import: worker.node.
"""
