"""gpu_check's `ops` check: the Triton RMSNorm(+residual) / rotary / SiLU-and-mul kernels
(pagellm/layers/triton_ops.py) against the layers' torch paths, and their times on CUDA."""

from __future__ import annotations

import torch

DEV = "cuda"  # set by gpu_check.main from --device


def _ops_compare(name: str, out: torch.Tensor, ref: torch.Tensor, max_ulp: int = 2) -> None:
    """float32: round-off; 16-bit: at most ``max_ulp`` apart, on at most 2% of the elements.

    Two ulps by default: a last-ulp change of a float32 intermediate (the variance's summation
    order, exp) moves a rounded 16-bit intermediate by one ulp, which the next multiply (by the
    weight, by up) can widen to two. Rotary has no such intermediate (the table is shared)."""
    if out.dtype == torch.float32:
        err = (out - ref).abs().max().item()
        ok = bool(torch.allclose(out, ref, rtol=1e-5, atol=1e-5))
        detail = f"max_err={err:.1e}"
    else:
        def ordered(t):
            i = t.contiguous().view(torch.int16).int()
            return torch.where(i < 0, -(i & 0x7FFF), i)

        dist = (ordered(out) - ordered(ref)).abs()
        frac = (dist > 0).float().mean().item()
        ok = dist.max().item() <= max_ulp and frac <= 0.02
        detail = f"max_ulp={dist.max().item()} off={frac:.3%}"
    print(f"  {name:44s} {detail} {'ok' if ok else 'FAIL'}", flush=True)
    assert ok and not out.isnan().any(), name


def _ops_time(fn) -> float:
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 50 * 1e3  # us


def check_ops() -> None:
    """Triton RMSNorm(+residual) / rotary / SiLU-and-mul (pagellm/layers/triton_ops.py) against
    the layers' torch paths; on CUDA also that the layers dispatch to them, and their times."""
    from pagellm.layers import triton_ops as ops
    from pagellm.layers.activation import SiluAndMul
    from pagellm.layers.norm import RMSNorm
    from pagellm.layers.rotary import RotaryEmbedding

    cuda = DEV == "cuda"
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        g = torch.Generator(device=DEV).manual_seed(0)

        def rnd(*shape, scale=1.0, g=g, dtype=dtype):
            return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)

        dt = str(dtype).removeprefix("torch.")
        for hidden, rows in ((4096, 256), (576, 7), (100, 1)):
            norm = RMSNorm(hidden, 1e-5).to(DEV, dtype)
            norm.weight.data.copy_(rnd(hidden, scale=0.3) + 1)
            x, r = rnd(rows, hidden + 64, scale=3.0)[:, :hidden], rnd(rows, hidden)
            out, summed = ops.rms_norm(x, norm.weight, norm.eps, r)
            ref, ref_summed = norm.forward_native(x, r)
            assert torch.equal(summed, ref_summed), "rms_norm residual sum"
            _ops_compare(f"rms_norm+res {dt} {rows}x{hidden}", out, ref)
            _ops_compare(f"rms_norm {dt} {rows}x{hidden}", ops.rms_norm(x, norm.weight, 1e-5)[0],
                         norm.forward_native(x))
            if cuda:
                assert torch.equal(norm(x, r)[0], out), "RMSNorm did not take the kernel"
        for hq, hk, d, rot in ((32, 8, 128, 128), (14, 2, 64, 64), (32, 8, 128, 64)):
            rope = RotaryEmbedding(d, rot, 4096, {"rope_type": "default", "rope_theta": 5e5})
            rope = rope.to(DEV)
            qkv = rnd(300, (hq + 2 * hk) * d, scale=2.0)
            pos = torch.randint(0, 4096, (300,), generator=g, device=DEV)
            q, k, _ = qkv.split([hq * d, hk * d, hk * d], dim=-1)
            ref_q, ref_k = rope.forward_native(pos, q, k)
            if cuda:  # the layer, in place on a copy
                q2, k2, _ = qkv.clone().split([hq * d, hk * d, hk * d], dim=-1)
                rope(pos, q2, k2)
            ops.rotary_(q, k, pos, rope.cos_cache, rope.sin_cache, d)
            _ops_compare(f"rotary q {dt} Hq={hq} Hk={hk} D={d} rot={rot}", q, ref_q, max_ulp=1)
            _ops_compare(f"rotary k {dt} Hq={hq} Hk={hk} D={d} rot={rot}", k, ref_k, max_ulp=1)
            if cuda:
                assert torch.equal(q2, q) and torch.equal(k2, k), "rotary did not take the kernel"
        for rows, d in ((256, 14336), (7, 100)):
            x = rnd(rows, 2 * d, scale=3.0)
            out = ops.silu_and_mul(x)
            _ops_compare(f"silu_and_mul {dt} {rows}x{d}", out, SiluAndMul.forward_native(x))
            if cuda:
                assert torch.equal(SiluAndMul()(x), out), "SiluAndMul did not take the kernel"
    if cuda:  # times at a decode-ish batch of 64 tokens, Llama-3-8B shapes, bf16
        g = torch.Generator(device=DEV).manual_seed(1)
        x = torch.randn(64, 4096, generator=g, device=DEV).bfloat16()
        norm = RMSNorm(4096).to(DEV, torch.bfloat16)
        rope = RotaryEmbedding(128, 128, 4096, {"rope_type": "default", "rope_theta": 5e5})
        rope = rope.to(DEV)
        qkv = torch.randn(64, 48 * 128, generator=g, device=DEV).bfloat16()
        q, k, _ = qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1)
        pos = torch.arange(64, device=DEV)
        gu = torch.randn(64, 2 * 14336, generator=g, device=DEV).bfloat16()
        cases = (("rms_norm+res", lambda: norm(x, x), lambda: norm.forward_native(x, x)),
                 ("rotary", lambda: rope(pos, q, k), lambda: rope.forward_native(pos, q, k)),
                 ("silu_and_mul", lambda: SiluAndMul()(gu), lambda: SiluAndMul.forward_native(gu)))
        for name, fused, native in cases:
            print(f"  time {name:13s} triton {_ops_time(fused):6.1f} us | "
                  f"torch {_ops_time(native):6.1f} us", flush=True)


def _moe_layer(num_experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype,
               seed: int):
    from pagellm.layers.fused_moe import FusedMoE

    g = torch.Generator(device=DEV).manual_seed(seed)
    moe = FusedMoE(num_experts, top_k, hidden, inter, renormalize=True).to(DEV)
    for w in (moe.w13_weight, moe.w2_weight):  # std 1/sqrt(fan-in): activations stay O(1)
        w.data.copy_(torch.randn(w.shape, generator=g, device=DEV) / w.shape[-1] ** 0.5)
    return moe.to(dtype)


def check_moe() -> None:
    """The grouped Triton MoE GEMM (pagellm/layers/triton_moe.py) at real shapes against the
    torch grouped path: float experts (the layer's CUDA path, also inside a CUDA graph) and int8
    / int4 experts dequantized in the kernel vs the "torch" backend on the same codes. bf16 is
    judged against a float32 computation on the same weights: the kernel's error must stay
    within twice the torch bf16 path's. Then times at 1 / 64 / 2048 tokens."""
    from pagellm.layers import triton_moe
    from pagellm.layers.fused_moe import route
    from pagellm.layers.quantization import parse_quantization

    cuda = DEV == "cuda"
    # (name, experts, top-k, hidden, expert width): Mixtral-8x7B, Qwen3-30B-A3B (one rank)
    shapes = (("mixtral", 8, 2, 4096, 14336), ("qwen3-30b-a3b", 128, 8, 2048, 768))
    if not cuda:  # the interpreter: tiny shapes, a smoke run of this check
        shapes = (("tiny", 6, 2, 64, 32),)
    token_counts = (1, 64, 2048) if cuda else (5,)

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a.double() - b.double()).norm() / b.double().norm())

    for name, e, k, h, i in shapes:
        moe = _moe_layer(e, k, h, i, torch.bfloat16, seed=0)
        ref32 = _moe_layer(e, k, h, i, torch.float32, seed=0)
        ref32.load_state_dict({n: p.float() for n, p in moe.state_dict().items()})
        g = torch.Generator(device=DEV).manual_seed(1)
        for t in token_counts:
            x = torch.randn(t, h, generator=g, device=DEV)
            logits = torch.randn(t, e, generator=g, device=DEV).bfloat16()
            weights, ids = route(logits, k, True, torch.bfloat16)
            xb = x.bfloat16()
            out = triton_moe.fused_experts(xb, triton_moe.ExpertWeight(moe.w13_weight),
                                           triton_moe.ExpertWeight(moe.w2_weight), weights, ids)
            torch_bf16 = moe._forward_grouped(xb, weights, ids)
            exact = ref32._forward_grouped(xb.float(), weights.float(), ids)
            err, base = rel(out, exact), rel(torch_bf16, exact)
            ok = err <= 2 * base + 1e-3 and not out.isnan().any()
            print(f"  moe {name} T={t} bf16: triton rel_err={err:.2e} torch rel_err={base:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
            assert ok, f"moe {name} T={t}"
            if cuda:
                assert torch.equal(moe(xb, logits), out), "FusedMoE took another path"
        if cuda:  # the layer inside a CUDA graph: no host-side counts, same result
            x = torch.randn(64, h, generator=g, device=DEV).bfloat16()
            logits = torch.randn(64, e, generator=g, device=DEV).bfloat16()
            eager = moe(x, logits)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                moe(x, logits)  # warm up (compiles) outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = moe(x, logits)
            graph.replay()
            torch.cuda.synchronize()
            ok = torch.equal(captured, eager)
            print(f"  moe {name} CUDA graph replay == eager: {'ok' if ok else 'FAIL'}")
            assert ok, f"moe {name} CUDA graph"
        for spec in ("int8", "int4"):
            layers = {}
            for backend in ("triton", "torch"):
                layer = _moe_layer(e, k, h, i, torch.bfloat16, seed=0)
                layer.quantize_(parse_quantization(spec), backend)
                layers[backend] = layer
            x = torch.randn(token_counts[-1], h, generator=g, device=DEV).bfloat16()
            logits = torch.randn(token_counts[-1], e, generator=g, device=DEV).bfloat16()
            err = rel(layers["triton"](x, logits), layers["torch"](x, logits))
            ok = err < 2e-2
            print(f"  moe {name} {spec} triton vs torch dequant: rel_err={err:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
            assert ok, f"moe {name} {spec}"
        if cuda:
            _moe_times(name, moe, layers["triton"], token_counts, g)
        del layers, moe, ref32
        if cuda:
            torch.cuda.empty_cache()


def _moe_times(name: str, moe, int4_moe, token_counts: tuple[int, ...], g) -> None:
    from pagellm.layers.fused_moe import route

    for t in token_counts:
        x = torch.randn(t, moe.hidden_size, generator=g, device=DEV).bfloat16()
        logits = torch.randn(t, moe.num_experts, generator=g, device=DEV).bfloat16()
        weights, ids = route(logits, moe.top_k, True, torch.bfloat16)
        fused = _ops_time(lambda: moe(x, logits))  # noqa: B023
        grouped = _ops_time(lambda: moe._forward_grouped(x, weights, ids))  # noqa: B023
        int4 = _ops_time(lambda: int4_moe(x, logits))  # noqa: B023
        print(f"  time moe {name} T={t:5d}: triton {fused:8.1f} us | torch grouped "
              f"{grouped:8.1f} us | triton int4 {int4:8.1f} us", flush=True)
