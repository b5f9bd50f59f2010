"""A job's life: submitted, enqueued, cancelled, resumed, deleted; and what it keeps in the store.

``submit`` (a prompt file checked, written and enqueued), ``enqueue`` (shards to the queue),
``lifecycle`` (cancel, delete, a name's lives), ``cancelmarks``, ``resume`` (whatever of a job is not
in the store, enqueued again), ``strays`` (shards in none of pending, queued or leased, rehomed),
``records`` (a job's stored records), ``serving`` (which live workers can take a job), ``prices``
(the pools' published prices), ``redisvalues`` (reading Redis values that may be malformed).

May import: nothing else of dispatcher.
"""
