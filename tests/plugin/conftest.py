"""pytester drives the plugin in throw-away test directories (enabled in tests/conftest.py).

pytester restores ``sys.modules`` between in-process runs: what a run imports first is imported
afresh by the next. Modules imported here are kept, so a class cached by a kept module (the
package's lazy ``precisiondiff.Workload``) stays the class every run sees.
"""
import torch._dynamo  # noqa: F401
import precisiondiff.runtime  # noqa: F401
