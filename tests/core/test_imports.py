"""The scheduler side of the package stays importable without torch (a fresh interpreter: this
test process has torch loaded already)."""

from __future__ import annotations

import os
import subprocess
import sys

import pagellm

ROOT = os.path.dirname(os.path.dirname(pagellm.__file__))


def test_scheduler_imports_no_torch() -> None:
    code = ("import sys, pagellm.core.scheduler; "
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'torch' in m)")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_top_level_names_load_lazily() -> None:
    code = ("import sys, pagellm; assert 'pagellm.entrypoints.llm' not in sys.modules; "
            "from pagellm import LLM, SamplingParams; "
            "assert LLM.__module__ == 'pagellm.entrypoints.llm'; "
            "assert set(pagellm.__all__) <= set(dir(pagellm))")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": ROOT}, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
