"""A job's events: recorded and signed (``events``), delivered to webhooks with retries (``courier``).

May import: dispatcher.status, dispatcher.jobs.
"""
