"""The CPU kernel library as a whole: the builds for each instruction set, the shapes the
entry points refuse (an error, never a signal), the prefetch slicing of decode attention for
every block size, and the plain PyTorch fallback where the kernels are off or cannot be built.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import pytest
import torch

from pagellm.config import CPU_ISAS, read_env
from pagellm.kernels import cpu_build, cpu_ops

needs_kernels = pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler")


@needs_kernels
def test_each_isa_build_runs_a_capped_set_of_paths():
    native = cpu_ops.kernel_paths()
    assert native[-1] == "generic" and set(native) <= set(cpu_ops.KERNEL_PATHS)
    assert list(cpu_build.ISA_FLAGS) == list(CPU_ISAS)
    for isa in CPU_ISAS:
        with cpu_ops.built_for(isa) as paths:
            assert paths == cpu_ops.kernel_paths()
            assert set(paths) <= set(native) and paths[-1] == "generic"
            if isa != "native":
                assert "amx" not in paths
            if isa in ("avx512", "generic"):
                assert "avx512-bf16" not in paths
            if isa == "generic":
                assert paths == ["generic"]
    assert cpu_ops.kernel_paths() == native  # the native build is back after each block


def test_cpu_isa_setting_is_checked():
    assert read_env({}).cpu_isa == "native"
    assert read_env({"PAGELLM_CPU_ISA": "AVX512"}).cpu_isa == "avx512"
    with pytest.raises(ValueError, match="PAGELLM_CPU_ISA"):
        read_env({"PAGELLM_CPU_ISA": "sse2"})


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_prefetch_slices_cover_every_block_size(dtype):
    """The slicing decode attention builds for a call (the same code the kernel runs, on every
    machine): every block size from 1 up, with fewer tokens than a 16-token tile among them,
    splits each block's cache lines into non-empty slices that cover it; no division by 0."""
    size = torch.tensor([], dtype=dtype).element_size()
    for heads, kv_heads, head_dim in [(1, 1, 64), (4, 2, 40), (9, 3, 64), (16, 1, 128),
                                      (32, 8, 64)]:
        for block_size in [*range(1, 130), 256]:
            slices = cpu_ops.paged_attention_slices(heads, kv_heads, head_dim, block_size, dtype)
            lines = math.ceil(block_size * kv_heads * head_dim * size / 64)
            for (got_lines, per), parts in zip(slices, (block_size // 16, heads, kv_heads),
                                               strict=True):
                assert got_lines == lines
                assert per >= 1 and per * max(parts, 1) >= lines, (block_size, parts, per)


@needs_kernels
def test_attention_kernels_refuse_shapes_they_cannot_index():
    """Query heads that are not whole groups of the kv heads, or an empty dimension: a
    ValueError naming the shape, before the kernel divides by anything."""
    query = torch.randn(2, 3, 64)
    k_cache = torch.zeros(4, 16, 2, 64)
    tables = torch.zeros(2, 2, dtype=torch.int32)
    lens = torch.tensor([5, 9], dtype=torch.int32)
    rows = torch.arange(2)
    with pytest.raises(ValueError, match="3 query heads over 2 kv heads"):
        cpu_ops.paged_attention(torch.empty_like(query), query, k_cache, k_cache.clone(),
                                tables, lens, rows, rows, 0.125)
    with pytest.raises(ValueError, match="0 kv heads"):
        empty = torch.zeros(4, 16, 0, 64)
        cpu_ops.paged_attention(torch.empty_like(query), query, empty, empty.clone(), tables,
                                lens, rows, rows, 0.125)
    assert not cpu_ops.paged_attention_supports(3, 2, 64, 16)
    assert not cpu_ops.paged_attention_supports(4, 2, 64, 0)
    assert cpu_ops.paged_attention_supports(4, 2, 64, 1)
    if cpu_ops.prefill_head_dim_supported(64, torch.float32):
        with pytest.raises(ValueError, match="3 query heads over 2 kv heads"):
            cpu_ops.prefill_attention(
                torch.empty_like(query), query, k_cache, k_cache.clone(), tables,
                torch.tensor([0], dtype=torch.int64), torch.tensor([2], dtype=torch.int32),
                torch.tensor([2], dtype=torch.int32), torch.tensor([0], dtype=torch.int64),
                0.125)


def _run_python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=300)


def test_disabled_or_unbuildable_kernels_fall_back(tmp_path):
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "import torch\nfrom pagellm.kernels import cpu_ops\nfrom pagellm.layers.norm import "
            "RMSNorm\nprint(cpu_ops.available())\nx = torch.randn(3, 8)\n"
            "print(RMSNorm(8)(x).shape)\n")
    off = _run_python(code, {"PAGELLM_CPU_KERNELS": "0"})
    assert off.returncode == 0, off.stderr
    assert off.stdout.split("\n")[0] == "False"
    broken = _run_python(code, {"CXX": "false", "PAGELLM_CACHE_DIR": str(tmp_path)})
    assert broken.returncode == 0, broken.stderr
    assert broken.stdout.split("\n")[0] == "False"
    assert "CPU kernels unavailable" in broken.stderr
    assert "torch.Size([3, 8])" in broken.stdout



@needs_kernels
def test_kernel_cache_is_private_and_foreign_libraries_are_not_loaded(tmp_path):
    """The kernels' folder is created 0700; a library that others may write, or that another
    user owns, is not loaded (the engine takes its PyTorch paths and says why)."""
    code = ("import logging; logging.basicConfig(level=logging.WARNING)\n"
            "from pagellm.kernels import cpu_ops\nprint(cpu_ops.available())\n")
    env = {"PAGELLM_CACHE_DIR": str(tmp_path), "PAGELLM_CPU_ISA": "generic"}
    built = _run_python(code, env)
    assert built.returncode == 0 and built.stdout.strip() == "True", built.stderr
    folder = tmp_path / "kernels"
    assert folder.stat().st_mode & 0o777 == 0o700
    (lib,) = folder.glob("cpu_ops-*.so")
    lib.chmod(0o666)
    refused = _run_python(code, env)
    assert refused.stdout.strip() == "False"
    assert "writable by group or others" in refused.stderr
    lib.chmod(0o755)
    assert _run_python(code, env).stdout.strip() == "True"
    if os.getuid() == 0:  # as root (CI), hand the file to another user
        os.chown(lib, 65534, -1)
        foreign = _run_python(code, env)
        assert foreign.stdout.strip() == "False" and "owned by uid 65534" in foreign.stderr
