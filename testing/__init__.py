"""Test support shipped beside the code, not inside tests: real servers and fleet helpers.

Used by the tests (``tests/``) and the benchmarks (``bench/``) alike; neither
imports the other.  Not installed with the package (``pyproject.toml``
installs ``renderfleet``, ``worker`` and ``dispatcher`` only): run from the
repository root, as ``make test`` and ``make bench`` do.

- :mod:`testing.fleet`: a Redis server we can kill, worker processes, the CLI as a user runs it;
- :mod:`testing.rig`: the chaos run's and the soak's servers and fleet, and what they read in Redis;
- :mod:`testing.servers`: moto's S3 in server mode, a Redis with TLS and a password;
- :mod:`testing.metadata`: a fake cloud metadata service (AWS IMDSv2, GCP) on loopback;
- :mod:`testing.messages`: a prompt's wire dict and a shard's message, built for tests.
"""
