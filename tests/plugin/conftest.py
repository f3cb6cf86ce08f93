"""pytester drives the plugin in throw-away test directories."""
import torch._dynamo  # noqa: F401  (imported once here: pytester restores sys.modules between runs)

pytest_plugins = ["pytester"]
