"""The dispatcher: what runs near the user (the CLI, the API, the monitor, the autoscaler).

Each sub-package's docstring says what lives there and what it may import
(``tests/unit/test_imports.py`` holds them to it); arrows point down this list:

* ``views/``: what a person or a program reads: the web page, ``show``, ``results``, estimates.
* ``fleet/``: the fleet's control loop: the monitor, the autoscaler and its backends, metrics.
* ``events/``: a job's signed events and their delivery to webhooks.
* ``status/``: the state of jobs and of the fleet, read from Redis and the store.
* ``jobs/``: a job's life: submit, enqueue, cancel, resume, delete, and its records.

The contract (``renderfleet``) is below all of them; nothing here imports the worker or torch.
"""
