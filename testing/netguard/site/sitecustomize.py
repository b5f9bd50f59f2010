"""The test run's guard in every Python process it starts (testing/netguard): on ``PYTHONPATH`` only
while tests run, never in the product.  Loaded from its file, so that nothing is added to ``sys.path``."""

import os

if os.environ.get("RENDERFLEET_NETGUARD_LOG"):
    import importlib.util

    _spec = importlib.util.spec_from_file_location(
        "renderfleet_netguard", os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "__init__.py")
    )
    if _spec is not None and _spec.loader is not None:
        _guard = importlib.util.module_from_spec(_spec)
        _spec.loader.exec_module(_guard)
        _guard.install()
