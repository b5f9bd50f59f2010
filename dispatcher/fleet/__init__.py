"""The fleet's control loop: what keeps jobs moving and pools sized.

``monitor`` (reaps leases, recovers shards, re-registers jobs Redis lost, delivers events),
``autoscale`` and ``policy`` (each pool sized to its backlog in seconds of work, never under
running work), ``backends`` (local processes, Kubernetes, KEDA, AWS), ``stagepools`` (pools
that serve a job's later stages), ``fleetmetrics`` (the fleet's Prometheus metrics).

May import: dispatcher.events, dispatcher.status, dispatcher.jobs.
"""
