"""pytester drives the plugin in throw-away test directories (enabled in tests/conftest.py)."""
import torch._dynamo  # noqa: F401  (imported once here: pytester restores sys.modules between runs)
