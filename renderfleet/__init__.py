"""renderfleet: a queue-based, spot-tolerant GPU render fleet.

The Python API (see :mod:`renderfleet.api`)::

    from renderfleet import Client

    job = Client().submit(["a red fox", "a blue bird"], model="tiny", size="64x64")
    job.wait(progress=True)

Importing this package does nothing but define names: no connection, no
model load, no thread, no torch (see tests/unit/test_imports.py).
"""

from renderfleet.api import Client, Job, PromptRequest
from renderfleet.version import __version__

__all__ = ["Client", "Job", "PromptRequest", "__version__"]
