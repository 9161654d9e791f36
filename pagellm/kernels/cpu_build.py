"""Build (once) and load the CPU kernels (``cpu_ops.cpp``, ``cpu_attention.cpp``,
``cpu_linear.cpp``, ``cpu_linear_vec.cpp``, ``cpu_decoder.cpp``, ``cpu_prefill.cpp``,
``cpu_prefill_vec.cpp``, ``cpu_moe.cpp``).

The library is compiled with the machine's C++ compiler the first time it is needed (a few seconds)
and cached under ``$PAGELLM_CACHE_DIR/kernels`` (default ``~/.cache/pagellm/kernels``), keyed by
the source, the flags, the compiler and the CPU's feature flags (it is built with
``-march=native``). Without a compiler, or with ``PAGELLM_CPU_KERNELS=0``, ``load()`` returns
None and callers use their plain PyTorch paths: the kernels make things faster, never possible.

``PAGELLM_CPU_ISA`` (or ``load(isa)``) caps the newest instruction set the build may use, so a
machine can run, and the tests can check, each older kernel path too: ``native`` (all the CPU
has: AMX, AVX-512 BF16, AVX-512), ``avx512-bf16`` (no AMX), ``avx512`` (no AMX, no BF16
instructions), ``generic`` (no AVX-512: the plain loops).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

from pagellm.config import read_env
from pagellm.models.gguf_cache import cache_root

logger = logging.getLogger(__name__)

_HERE = Path(__file__).parent
SOURCES = [_HERE / "cpu_ops.cpp", _HERE / "cpu_attention.cpp", _HERE / "cpu_linear.cpp",
           _HERE / "cpu_linear_vec.cpp", _HERE / "cpu_decoder.cpp", _HERE / "cpu_prefill.cpp",
           _HERE / "cpu_prefill_vec.cpp", _HERE / "cpu_moe.cpp",
           _HERE / "cpu_kv_quant.cpp"]
HEADERS = [_HERE / "cpu_common.h", _HERE / "cpu_amx.h", _HERE / "cpu_prefill.h",
           _HERE / "cpu_attention_vec.h", _HERE / "cpu_attention_amx.h",
           _HERE / "cpu_entry_points.h", _HERE / "cpu_kv_quant.h",
           _HERE / "cpu_kv_quant_vec.h", _HERE / "cpu_kv_quant_tile.h",
           _HERE / "cpu_kv_quant_dot.h",
           _HERE / "cpu_moe_formats.h"]
ABI_VERSION = 10
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]
_NO_AMX = ["-mno-amx-tile", "-mno-amx-bf16", "-mno-amx-int8"]
# The flags that cap -march=native at each CPU_ISAS level (x86-64; elsewhere every level is the
# native build, which has only the plain loops).
ISA_FLAGS = {"native": [], "avx512-bf16": _NO_AMX, "avx512": [*_NO_AMX, "-mno-avx512bf16"],
             "generic": [*_NO_AMX, "-mno-avx512f"]}

_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}


def kernels_enabled() -> bool:
    return read_env().cpu_kernels


def _isa_flags(isa: str) -> list[str]:
    if isa not in ISA_FLAGS:
        raise ValueError(f"unknown CPU kernel ISA {isa!r}; one of {', '.join(ISA_FLAGS)}")
    return ISA_FLAGS[isa] if platform.machine().lower() in ("x86_64", "amd64") else []


def _compiler() -> str | None:
    for name in (read_env().cxx, "g++", "c++", "clang++"):
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


def _build_key(compiler: str, flags: list[str]) -> str:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                                 timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        version = ""
    h = hashlib.sha256()
    for part in (*(p.read_bytes() for p in SOURCES + HEADERS), " ".join(flags).encode(),
                 version.encode(), _cpu_flags().encode()):
        h.update(part)
    return h.hexdigest()[:16]


def _private_dir(folder: Path) -> None:
    """``folder``, created 0700 (its parents as the umask says); an existing one of ours is
    narrowed to 0700: the libraries in it are code this process will run."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if folder.stat().st_uid == os.getuid():
        folder.chmod(0o700)


def untrusted(path: Path) -> str | None:
    """Why a kernel library (or its folder) must not be loaded: another user owns it, or others
    may write it; None when it may be."""
    st = path.stat()
    if st.st_uid != os.getuid():
        return f"{path} is owned by uid {st.st_uid}, not by this process's user"
    if st.st_mode & 0o022:
        return f"{path} is writable by group or others (mode {st.st_mode & 0o777:o})"
    return None


def library_path(compiler: str, isa: str) -> Path:
    """Where the library for ``isa`` built with ``compiler`` is cached."""
    suffix = "" if isa == "native" else f"-{isa}"
    flags = [*FLAGS, *_isa_flags(isa)]
    return Path(cache_root()) / "kernels" / f"cpu_ops-{_build_key(compiler, flags)}{suffix}.so"


def _compile(compiler: str, flags: list[str], target: Path) -> None:
    _private_dir(target.parent)
    # Build beside the target and rename: concurrent processes (TP workers, test runs) may build
    # at once; each rename is atomic and every built file is identical.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        proc = subprocess.run([compiler, *flags, *map(str, SOURCES), "-o", tmp],
                              capture_output=True, text=True, timeout=300)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip()[-2000:])
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load(isa: str | None = None) -> ctypes.CDLL | None:
    """The kernel library built for ``isa`` (None: ``PAGELLM_CPU_ISA``, default native), built
    on first use; None where it cannot be built (logged once per ISA)."""
    if not kernels_enabled():
        return None
    isa = isa or read_env().cpu_isa
    flags = [*FLAGS, *_isa_flags(isa)]
    with _lock:
        if isa in _loaded:
            return _loaded[isa]
        lib = None
        compiler = _compiler()
        if compiler is None:
            logger.warning("no C++ compiler found (set CXX): CPU kernels disabled, using the "
                           "slower PyTorch paths")
        else:
            target = library_path(compiler, isa)
            try:
                if not target.exists():
                    logger.info("building CPU kernels (%s) with %s into %s", isa, compiler,
                                target)
                    _compile(compiler, flags, target)
                why = untrusted(target.parent) or untrusted(target)
                if why:
                    raise RuntimeError(f"not loading the kernel library: {why}")
                lib = ctypes.CDLL(str(target))
                if lib.pagellm_abi_version() != ABI_VERSION:
                    raise RuntimeError("stale kernel library (ABI version differs)")
            except (OSError, RuntimeError, subprocess.SubprocessError) as e:
                logger.warning("CPU kernels unavailable, using the slower PyTorch paths: %s", e)
                lib = None
        _loaded[isa] = lib
        return lib
