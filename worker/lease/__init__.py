"""The lease protocol: how a worker takes a shard, keeps it and hands it back.

``tasks`` (the one Celery task, thin), ``service`` (a shard's whole turn in this worker: claim,
render through ``render.runner``, end), ``ledger`` (the lease in Redis: heartbeat, fence, counts),
``prefetch`` (the next shard claimed while this one renders), ``queueguard`` (what a message from
the broker must be before it is taken), ``loading`` (the registration a worker shows while its
first model loads).

May import: worker.render, worker.accounting, worker.node.
"""
