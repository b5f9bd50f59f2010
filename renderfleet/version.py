"""renderfleet's version: pyproject.toml's, one module with no imports (renderfleet/formats.py names it in a refusal).

CHANGELOG.md says what each version changed.
"""

__version__ = "0.5.0"
