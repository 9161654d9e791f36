"""Shared test helpers: tiny random Hugging Face models (Llama, Qwen2/3, Mistral, Phi-3, Mixtral,
Qwen3-MoE) on disk.

``write_tiny_model(path, arch)`` saves a transformers model with random weights (float32
safetensors) plus a small byte-level BPE tokenizer whose size is the model's vocab_size, so that
every loader path (config, tokenizer, safetensors) runs exactly as for a real checkpoint.
Heavy imports stay inside the functions: core tests that never ask for a model stay fast.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import pytest
from tiny_tokenizer import CHAT_TEMPLATE, build_test_tokenizer  # noqa: F401 (re-exported)

TINY_ARCHS = ("llama", "llama-tied", "llama-rope3", "qwen2", "mistral", "qwen3", "phi3",
              "mixtral", "qwen3-moe", "qwen3-next", "qwen3.5", "qwen3.5-moe", "granite4",
              "nemotron-h")
# Mamba-2 hybrids: their A_log / D / dt_bias (fixed at init) get random values too.
MAMBA_ARCHS = ("granite4", "nemotron-h")

# Hybrid linear-attention layers: Gated DeltaNet, full attention, Gated DeltaNet, full attention.
HYBRID_LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention",
                      "full_attention"]

def tiny_config(arch: str = "llama", **overrides: Any) -> Any:
    """A transformers config for a 2-layer model with GQA (4 query heads, 2 KV heads)."""
    from transformers import LlamaConfig, MistralConfig, Phi3Config, Qwen2Config, Qwen3Config

    tok = build_test_tokenizer()
    common: dict[str, Any] = dict(
        vocab_size=len(tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        initializer_range=0.25,  # larger than real models: varied greedy text, clear margins
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    if arch in ("llama", "llama-tied", "llama-rope3"):
        cfg = dict(common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        if arch == "llama-tied":
            cfg["tie_word_embeddings"] = True
        if arch == "llama-rope3":
            cfg["rope_parameters"] = {
                "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            }
        cfg.update(overrides)
        return LlamaConfig(**cfg)
    if arch == "qwen2":
        cfg = dict(common, num_key_value_heads=1, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cfg.update(overrides)
        return Qwen2Config(**cfg)
    if arch == "mistral":
        cfg = dict(common, num_attention_heads=8, num_key_value_heads=2, head_dim=16,
                   sliding_window=None)
        cfg.update(overrides)
        return MistralConfig(**cfg)
    if arch == "qwen3":
        # head_dim 32, not hidden / heads (16): read from the config, as Qwen3 does.
        cfg = dict(common, head_dim=32, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cfg.update(overrides)
        return Qwen3Config(**cfg)
    if arch == "phi3":
        # longrope with an original context (32) shorter than the tests' prompts, whose
        # max_position_embeddings (256) selects the long factors (pagellm/layers/rotary.py).
        half = common["hidden_size"] // common["num_attention_heads"] // 2
        cfg = dict(common, original_max_position_embeddings=32, sliding_window=None,
                   rope_parameters={
                       "rope_type": "longrope", "rope_theta": 10000.0,
                       "short_factor": [1.0 + 0.05 * i for i in range(half)],
                       "long_factor": [1.0 + 0.9 * i for i in range(half)]})
        cfg.update(overrides)
        return Phi3Config(**cfg)
    if arch == "mixtral":
        # 4 experts, top-2, expert width 32.
        from transformers import MixtralConfig

        cfg = dict(common, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2,
                   sliding_window=None, rope_parameters={"rope_type": "default",
                                                         "rope_theta": 1000000.0})
        cfg.update(overrides)
        return MixtralConfig(**cfg)
    if arch == "qwen3-moe":
        # 3 layers: layer 1 dense (mlp_only_layers), 0 and 2 sparse; top-k not renormalized.
        from transformers import Qwen3MoeConfig

        cfg = dict(common, num_hidden_layers=3, head_dim=32, num_experts=4,
                   num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=[1],
                   decoder_sparse_step=1, norm_topk_prob=False,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
        cfg.update(overrides)
        return Qwen3MoeConfig(**cfg)
    if arch in ("qwen3-next", "qwen3.5", "qwen3.5-moe"):
        # Qwen3-Next: 2 key heads serving 4 value heads, conv kernel 4, partial rotary 0.25, MoE
        # with a shared expert on layers 0, 2, 3 (layer 1 dense). Qwen3.5: the dense text model.
        linear = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
                      linear_value_head_dim=16, linear_conv_kernel_dim=4, head_dim=32,
                      num_hidden_layers=4, layer_types=HYBRID_LAYER_TYPES,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                       "partial_rotary_factor": 0.25})
        if arch == "qwen3-next":
            from transformers import Qwen3NextConfig

            cfg = dict(common, **linear, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48,
                       decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True)
            cfg.update(overrides)
            return Qwen3NextConfig(**cfg)
        if arch == "qwen3.5-moe":  # every layer sparse, top-k always renormalized
            from transformers import Qwen3_5MoeTextConfig

            cfg = dict(common, **linear, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32, shared_expert_intermediate_size=48)
            cfg.update(overrides)
            return Qwen3_5MoeTextConfig(**cfg)
        from transformers import Qwen3_5TextConfig

        cfg = dict(common, **linear)
        cfg.update(overrides)
        return Qwen3_5TextConfig(**cfg)
    mamba = dict(hidden_size=64, vocab_size=common["vocab_size"], num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=256,
                 initializer_range=0.25, tie_word_embeddings=False,
                 **{k: common[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")})
    if arch == "granite4":
        # Mamba-2, attention, Mamba-2, attention; 4 heads x 32, 2 B/C groups, SSD chunk 32;
        # MoE (4 experts, top-2) + shared MLP; Granite's four scalars away from 1.
        from transformers import GraniteMoeHybridConfig

        cfg = dict(mamba, num_hidden_layers=4, layer_types=["mamba", "attention"] * 2,
                   intermediate_size=32, rms_norm_eps=1e-5, mamba_n_heads=4, mamba_d_head=32,
                   mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=32,
                   num_local_experts=4, num_experts_per_tok=2, shared_intermediate_size=48,
                   embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2,
                   logits_scaling=2.5, position_embedding_type="rope",
                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
        cfg.update(overrides)
        return GraniteMoeHybridConfig(**cfg)
    if arch == "nemotron-h":
        # Mamba-2, MoE, attention, Mamba-2, MLP: the attention and the second Mamba-2 layer
        # are caches 1 and 2. MoE: 4 experts in 2 groups, the best group's top-2.
        from transformers import NemotronHConfig

        cfg = dict(mamba, head_dim=16, intermediate_size=96, layer_norm_epsilon=1e-5,
                   layers_block_type=["linear_attention", "moe", "full_attention",
                                      "linear_attention", "mlp"],
                   mamba_num_heads=4, mamba_head_dim=32, n_groups=2, ssm_state_size=16,
                   conv_kernel=4, chunk_size=32, n_routed_experts=4, num_experts_per_tok=2,
                   moe_intermediate_size=32, moe_shared_expert_intermediate_size=48, n_group=2,
                   topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.5)
        cfg.update(overrides)
        return NemotronHConfig(**cfg)
    raise ValueError(f"unknown tiny arch {arch!r}; one of {TINY_ARCHS}")


def write_tiny_model(path: str | Path, arch: str = "llama", seed: int = 0,
                     **overrides: Any) -> Path:
    """Save a random-weight HF model (float32 safetensors) and the test tokenizer to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(path)
    config = tiny_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    # Non-trivial norm weights, so a loader that skips them cannot pass.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ("norm" in name and arch in ("qwen3-next", "qwen3.5", "qwen3.5-moe")
                    and ".linear_attn." not in name):
                p.uniform_(-0.5, 0.5)  # these norms scale by 1 + weight
            elif "norm" in name:
                p.uniform_(0.5, 1.5)
            elif name.endswith(".bias"):
                p.normal_(0.0, 0.1)
            elif arch in MAMBA_ARCHS and name.endswith((".A_log", ".D", ".dt_bias")):
                p.uniform_(-1.0, 1.0)
        for name, b in model.named_buffers():
            if name.endswith(".e_score_correction_bias"):  # Nemotron-H's router
                b.uniform_(-0.1, 0.1)
    model.save_pretrained(path, safe_serialization=True)
    build_test_tokenizer().save_pretrained(path)
    return path


@functools.cache
def cpu_kernel_isas() -> tuple[str, ...]:
    """The kernel builds to test here, one per kernel path this machine can run (newest first:
    the native build, then builds capped below AMX, AVX512-BF16 and AVX-512; see
    ``pagellm.kernels.cpu_build.ISA_FLAGS``); empty without the kernels."""
    from pagellm.kernels import cpu_build, cpu_ops

    if not cpu_ops.available():
        return ()
    newest: dict[str, str] = {}
    for isa in cpu_build.ISA_FLAGS:
        try:
            with cpu_ops.built_for(isa) as paths:
                newest.setdefault(paths[0], isa)
        except RuntimeError:  # a compiler without the -mno-* flags: the summary line tells
            continue
    return tuple(newest.values())


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    # Tests that use the `cpu_isa` fixture run once per kernel build (cpu_kernel_isas).
    if "cpu_isa" in metafunc.fixturenames:
        metafunc.parametrize("cpu_isa", cpu_kernel_isas() or ("none",), indirect=True)


@pytest.fixture
def cpu_isa(request: pytest.FixtureRequest):
    """The CPU kernels' wrappers call the build for ``request.param`` during the test (the
    native build: the machine's newest path); yields its kernel paths, newest first."""
    from pagellm.kernels import cpu_ops

    if request.param == "none":
        yield []
        return
    with cpu_ops.built_for(request.param) as paths:
        _PATHS_TESTED.add(paths[0])
        yield paths


_PATHS_TESTED: set[str] = set()  # the newest path of each build a kernel test ran on


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    # Say which CPU kernel paths this run exercised: a green run on one kind of CPU is not one
    # on every kind (docs/attention.md lists which CPU runs which path).
    if "pagellm.kernels.cpu_ops" not in sys.modules:
        return
    from pagellm.kernels import cpu_ops

    native = cpu_ops.kernel_paths()
    if not native:
        terminalreporter.write_line("CPU kernels: not built (plain PyTorch paths only)")
        return
    tested = [p for p in cpu_ops.KERNEL_PATHS if p in _PATHS_TESTED]
    missing = [p for p in cpu_ops.KERNEL_PATHS if p not in native]
    terminalreporter.write_line(
        f"CPU kernel paths on this machine: {', '.join(native)}; kernel tests ran on: "
        f"{', '.join(tested) or 'none'}; this CPU cannot run: {', '.join(missing) or 'none'}")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory):
    """``tiny_model_dir(arch)`` -> folder of that tiny model, written once per session."""
    cache: dict[str, Path] = {}

    def get(arch: str = "llama") -> Path:
        if arch not in cache:
            cache[arch] = write_tiny_model(tmp_path_factory.mktemp(f"tiny-{arch}"), arch)
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_llama_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tiny_model_dir) -> Path:
    return tiny_model_dir("qwen2")


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Any:
    """The tokenizer every tiny model ships with (``len(tok) == config.vocab_size``)."""
    return build_test_tokenizer()


@pytest.fixture(scope="session")
def make_tiny_config():
    """``make_tiny_config(arch, **overrides)`` -> transformers config (see ``tiny_config``)."""
    return tiny_config


@pytest.fixture(scope="session")
def make_tiny_model():
    """``make_tiny_model(path, arch, seed=0, **overrides)`` -> path of a saved tiny model."""
    return write_tiny_model
