"""What a person or a program reads about jobs and the fleet.

``web`` and ``http`` (the monitor's page and its JSON API, one server), ``show`` (the terminal's
view of a job), ``thumbs`` and ``manifest`` (an image's thumbnail, a job's manifest of results),
``jobids`` (which jobs a store holds), ``estimate`` (time and cost before a submit), ``localrun``
(``renderfleet run``: everything on this machine, watched).

May import: dispatcher.fleet, dispatcher.events, dispatcher.status, dispatcher.jobs.
"""
