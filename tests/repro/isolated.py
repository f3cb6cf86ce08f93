"""Run a written repro the way the kernel team would: a fresh ``python -I`` process whose
sys.path holds the repro and only the extension modules copied next to it, never precisiondiff."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from typing import Dict, Iterable, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# precisiondiff is installed in this environment (editable): the isolated process blocks it, so
# a repro that tried to import it would fail
_LAUNCH = ("import runpy, sys; sys.modules['precisiondiff'] = None; sys.path.insert(0, {site!r}); "
           "sys.argv = [{script!r}]; runpy.run_path({script!r}, run_name='__main__')")


def run_repro(repro_dir: str, site: str, *, packages: Iterable[str] = (), imports: str = "",
              env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    """``python -I repro.py`` with ``site`` (where ``packages``, paths relative to the repository,
    are copied with their modification times) first on sys.path and ``REPRO_IMPORT=imports``."""
    os.makedirs(site, exist_ok=True)
    for rel in packages:
        src, dst = os.path.join(ROOT, rel), os.path.join(site, rel)
        if os.path.isdir(src):
            shutil.copytree(src, dst, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            os.makedirs(os.path.dirname(dst), exist_ok=True)
            shutil.copy2(src, dst)
    code = _LAUNCH.format(site=site, script=os.path.join(repro_dir, "repro.py"))
    clean = {"PATH": os.environ.get("PATH", ""), "HOME": os.environ.get("HOME", "/tmp"), "REPRO_IMPORT": imports,
             **(env or {})}
    return subprocess.run([sys.executable, "-I", "-c", code], capture_output=True, text=True, cwd=site, env=clean,
                          timeout=300)
