"""Build (once) and load the CPU kernels (``cpu_ops.cpp``, ``cpu_attention.cpp``,
``cpu_linear.cpp``, ``cpu_linear_vec.cpp``, ``cpu_decoder.cpp``, ``cpu_prefill.cpp``,
``cpu_prefill_vec.cpp``).

The library is compiled with the machine's C++ compiler the first time it is needed (about 3 s)
and cached under ``$PAGELLM_CACHE_DIR/kernels`` (default ``~/.cache/pagellm/kernels``), keyed by
the source, the flags, the compiler and the CPU's feature flags (it is built with
``-march=native``). Without a compiler, or with ``PAGELLM_CPU_KERNELS=0``, ``load()`` returns
None and callers use their plain PyTorch paths: the kernels make things faster, never possible.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from pagellm.models.gguf_cache import cache_root

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_ops.cpp", _HERE / "cpu_attention.cpp", _HERE / "cpu_linear.cpp",
           _HERE / "cpu_linear_vec.cpp", _HERE / "cpu_decoder.cpp", _HERE / "cpu_prefill.cpp",
           _HERE / "cpu_prefill_vec.cpp"]
HEADERS = [_HERE / "cpu_common.h", _HERE / "cpu_amx.h", _HERE / "cpu_prefill.h"]
ABI_VERSION = 8
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def kernels_enabled() -> bool:
    return os.environ.get("PAGELLM_CPU_KERNELS", "1").lower() not in ("0", "false", "no", "off")


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "g++", "c++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return ""


def _build_key(compiler: str) -> str:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(FLAGS).encode(),
                 version.encode(), _cpu_flags().encode()):
        h.update(part)
    return h.hexdigest()[:16]


def _compile(compiler: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: concurrent processes (TP workers, test runs) may build
    # at once; each rename is atomic and every built file is identical.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-2000:])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load() -> ctypes.CDLL | None:
    """The kernel library, built on first use; None where it cannot be built (logged once)."""
    if not kernels_enabled():
        return None
    with _lock:
        if "lib" in _loaded:
            return _loaded["lib"]
        lib = None
        compiler = _compiler()
        if compiler is None:
            logger.warning("no C++ compiler found (set CXX): CPU kernels disabled, using the "
                           "slower PyTorch paths")
        else:
            target = Path(cache_root()) / "kernels" / f"cpu_ops-{_build_key(compiler)}.so"
            try:
                if not target.exists():
                    logger.info("building CPU kernels with %s into %s", compiler, target)
                    _compile(compiler, target)
                lib = ctypes.CDLL(str(target))
                if lib.pagellm_abi_version() != ABI_VERSION:
                    raise RuntimeError("stale kernel library (ABI version differs)")
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                logger.warning("CPU kernels unavailable, using the slower PyTorch paths: %s", e)
                lib = None
        _loaded["lib"] = lib
        return lib
