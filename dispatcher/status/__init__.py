"""The state of jobs and of the fleet, as Redis and the store say it: one reading for every view.

``status`` (a job's and the fleet's status), ``stagestatus`` (a job's stages and their figures),
``redisload`` (what the Redis itself holds and how full it is).

May import: dispatcher.jobs.
"""
