"""renderfleet: a queue-based, spot-tolerant GPU render fleet.

Importing this package does nothing but define names: no connection, no
model load, no thread (see tests/unit/test_imports.py).
"""

__version__ = "0.1.0"
