"""GPU checks for the Triton backend and CUDA graphs: prepared on CPU, meant for a CUDA machine.

    python scripts/gpu_check.py                    # every check
    python scripts/gpu_check.py --only sweep,paged # a subset: tests, sweep, paged, engine, bench,
                                                   # throughput, ops, moe

1. tests  - tests/attention/test_triton_backend.py and tests/layers/test_triton_moe.py compiled
            for real (no interpreter); needs pytest.
2. sweep  - realistic shapes (Hq 32 / Hkv 8 / D 128, contexts to 2k, mixed batches, bf16/fp16/
            fp32, key segments) against dense float64 attention.
3. paged  - a tiny random Llama from transformers whose attention is routed through the backend
            over a NaN-filled paged cache, driven as flat mixed batches (chunked prefill + decode);
            greedy tokens must equal transformers' own (sdpa, full recompute).
4. engine - pagellm.LLM(attention_backend="triton") greedy vs transformers on the same weights,
            with decode CUDA graphs (padded and exact buckets) and with --enforce-eager;
            reported as SKIPPED with the reason if the engine cannot be built here.
5. bench  - decode attention bandwidth (K/V bytes read / kernel time) vs the HBM peak, key
            segments auto vs off, next to torch SDPA on dense K/V.
6. throughput - the engine with decode CUDA graphs vs --enforce-eager, on dummy weights of a
            ~1B Llama config (Llama-3.2-1B shapes) and on the default model (bf16), each run in
            its own process: decode step time and tokens/s at batch 1/16/64, the decode memory
            bandwidth achieved (weights + K/V read per step / step time) as a fraction of a
            measured device copy bandwidth, capture time and graph memory vs the reservation.
7. ops    - the Triton RMSNorm(+residual) / rotary / SiLU-and-mul kernels against the layers'
            torch paths (bf16/fp16: <= 2 ulp, rotary 1, on at most 2% of elements), that the
            layers dispatch to them, and their time next to the torch ops at 64 tokens.
8. moe    - the grouped Triton MoE GEMM at Mixtral-8x7B and Qwen3-30B-A3B shapes against the
            torch grouped path (bf16 error vs float32 within twice the torch path's), inside a
            CUDA graph, int8/int4 experts dequantized in the kernel, and times at 1/64/2048 tokens.
Needs torch, triton, transformers. Exit status 1 when any check fails. Budget: about 10 minutes
on one H100/H200 (throughput: 4 engine processes, each capped at THROUGHPUT_TIMEOUT_S).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import gpu_check_ops  # noqa: E402  (a sibling: python puts scripts/ on the path)
import gpu_check_throughput  # noqa: E402
from gpu_check_ops import check_moe, check_ops  # noqa: E402
from gpu_check_throughput import (  # noqa: E402
    check_throughput,
    save_word_tokenizer,
    throughput_worker,
)

from pagellm.attention.backend import AttentionMetadata  # noqa: E402

try:  # `--help` and the CPU syntax check work without triton
    from pagellm.attention.triton_backend import (
        TritonAttentionBackend,
        _num_sms,
        choose_num_segments,
    )
    from pagellm.attention.triton_kernels import paged_attention
except ImportError as e:
    TRITON_MISSING: str | None = repr(e)
else:
    TRITON_MISSING = None

DEV = "cuda"
PEAK_GBPS = {"H200": 4800, "H100": 3350, "A100": 2039, "L40S": 864, "A10": 600, "4090": 1008}


def make_batch(seqs, block_size, hq, hkv, d, dtype, seed=0):
    """Random paged batch [(context_len, query_len)]: returns (inputs, caches, meta, reference)."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    nbs = [math.ceil((c + q) / block_size) for c, q in seqs]
    ids = list(range(sum(nbs) + 2))
    random.Random(seed).shuffle(ids)
    tables = torch.zeros(len(seqs), max(nbs), dtype=torch.int32, device=DEV)
    shape = (len(ids), block_size, hkv, d)
    kc = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    vc = torch.full(shape, float("nan"), dtype=dtype, device=DEV)
    keys, values, slots, qs, refs = [], [], [], [], []
    for i, ((c, q), nb) in enumerate(zip(seqs, nbs, strict=True)):
        tables[i, :nb] = torch.tensor([ids.pop() for _ in range(nb)], device=DEV)
        pos = torch.arange(c + q, device=DEV)
        slot = tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = torch.randn(c + q, hkv, d, generator=g, device=DEV).to(dtype)
        v = torch.randn(c + q, hkv, d, generator=g, device=DEV).to(dtype)
        qq = torch.randn(q, hq, d, generator=g, device=DEV).to(dtype)
        kc.view(-1, hkv, d)[slot[:c]] = k[:c]
        vc.view(-1, hkv, d)[slot[:c]] = v[:c]
        keys.append(k[c:]), values.append(v[c:]), slots.append(slot[c:]), qs.append(qq)
        kk = k.double().repeat_interleave(hq // hkv, 1)
        vv = v.double().repeat_interleave(hq // hkv, 1)
        s = torch.einsum("qhd,khd->hqk", qq.double(), kk) * d**-0.5
        allowed = pos[None, :] <= (c + torch.arange(q, device=DEV))[:, None]
        p = s.masked_fill(~allowed, -math.inf).softmax(-1)
        refs.append(torch.einsum("hqk,khd->qhd", p, vv))
    qsl = [0]
    for _, q in seqs:
        qsl.append(qsl[-1] + q)
    lens = [c + q for c, q in seqs]
    meta = AttentionMetadata(
        num_tokens=qsl[-1], num_seqs=len(seqs), slot_mapping=torch.cat(slots),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=DEV),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=DEV), block_tables=tables,
        max_query_len=max(q for _, q in seqs), max_seq_len=max(lens),
        query_start_loc_cpu=qsl, seq_lens_cpu=lens,
        is_decode_only=all(q == 1 for _, q in seqs),
    )  # fmt: skip
    inputs = (torch.cat(qs), torch.cat(keys), torch.cat(values))
    return inputs, (kc, vc), meta, torch.cat(refs)


def check_tests() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "pytest", "-q", "tests/attention/test_triton_backend.py",
           "tests/layers/test_triton_moe.py"]
    if subprocess.run(cmd, cwd=ROOT, env=env).returncode != 0:
        raise AssertionError("kernel tests failed (is pytest installed?)")


def check_sweep() -> None:
    tol = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}
    mixed = [(2000, 1), (1023, 1), (16, 1), (0, 1), (500, 300), (0, 257), (31, 64), (0, 1)]
    decode = [(c, 1) for c in (1, 100, 777, 2048, 4000)]
    shapes = ((32, 8, 128, 16), (32, 32, 64, 32), (28, 4, 128, 16), (16, 2, 96, 32))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for hq, hkv, d, bs in shapes:
            for name, seqs in (("mixed", mixed), ("decode", decode)):
                (q, k, v), (kc, vc), meta, ref = make_batch(seqs, bs, hq, hkv, d, dtype)
                out = TritonAttentionBackend(hq, d, hkv, d**-0.5).forward(q, k, v, kc, vc, meta)
                err = (out.double() - ref).abs().max().item()
                ok = err <= tol[dtype] and not out.isnan().any()
                print(f"  {name:6s} {str(dtype):15s} Hq={hq:2d} Hkv={hkv:2d} D={d:3d} bs={bs} "
                      f"max_err={err:.2e} {'ok' if ok else 'FAIL'}")
                assert ok, "sweep mismatch"
                if name == "decode":  # every segment count agrees with the reference
                    for segs in (1, 2, 16):
                        out2 = paged_attention(q, kc, vc, torch.empty_like(q), meta.query_start_loc,
                                               meta.seq_lens, meta.block_tables, meta.num_seqs, 1,
                                               d**-0.5, num_segments=segs)
                        assert (out2.double() - ref).abs().max().item() <= tol[dtype], segs


def tiny_llama(seed: int = 0, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return cfg, LlamaForCausalLM(cfg).to(DEV, dtype).eval()


@torch.no_grad()
def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    model.config._attn_implementation = "sdpa"
    toks = list(prompt)
    for _ in range(n):  # full recompute each step: no cache involved at all
        toks.append(int(model(torch.tensor([toks], device=DEV)).logits[0, -1].argmax()))
    return toks[len(prompt):]


_STEP: dict = {}


def _paged_attn_fn(module, query, key, value, attention_mask, scaling=None, **kwargs):
    meta, caches, backend = _STEP["meta"], _STEP["caches"], _STEP["backend"]
    k_cache, v_cache = caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [1, H, T, D] -> [T, H, D]
    k, v = key[0].transpose(0, 1).contiguous(), value[0].transpose(0, 1).contiguous()
    return backend.forward(q.contiguous(), k, v, k_cache, v_cache, meta)[None], None


@torch.no_grad()
def check_paged(dtype=torch.float32, n_new: int = 12, budget: int = 48, bs: int = 16) -> None:
    from transformers import AttentionInterface

    cfg, model = tiny_llama(dtype=dtype)
    AttentionInterface.register("pagellm_triton", _paged_attn_fn)
    hd = cfg.hidden_size // cfg.num_attention_heads
    prompts = [[(7 * i + 3 * j) % 500 + 1 for j in range(n)] for i, n in enumerate((70, 5, 33, 1))]
    want = [hf_greedy(model, p, n_new) for p in prompts]
    model.config._attn_implementation = "pagellm_triton"
    free = list(range(64))
    random.Random(0).shuffle(free)
    shape = (64, bs, cfg.num_key_value_heads, hd)
    _STEP["caches"] = [(torch.full(shape, math.nan, dtype=dtype, device=DEV),
                        torch.full(shape, math.nan, dtype=dtype, device=DEV)) for _ in range(2)]
    _STEP["backend"] = TritonAttentionBackend(8, hd, cfg.num_key_value_heads, hd**-0.5)
    toks = [list(p) for p in prompts]
    done, tables = [0] * len(prompts), [[] for _ in prompts]
    while any(len(t) - len(p) < n_new for t, p in zip(toks, prompts, strict=True)):
        ids, pos, slots, qsl, lens, rows, left = [], [], [], [0], [], [], budget
        for i, t in enumerate(toks):  # running first, each catches up within the token budget
            n = min(len(t) - done[i], left)
            if n == 0 or len(t) - len(prompts[i]) >= n_new:
                continue
            while len(tables[i]) * bs < done[i] + n:
                tables[i].append(free.pop())
            ids += t[done[i]:done[i] + n]
            pos += range(done[i], done[i] + n)
            slots += [tables[i][p // bs] * bs + p % bs for p in range(done[i], done[i] + n)]
            rows.append(i), qsl.append(len(ids)), lens.append(done[i] + n)
            left -= n
        bt = torch.zeros(len(rows), max(len(tables[i]) for i in rows), dtype=torch.int32)
        for r, i in enumerate(rows):
            bt[r, :len(tables[i])] = torch.tensor(tables[i])
        _STEP["meta"] = AttentionMetadata(
            len(ids), len(rows), torch.tensor(slots, device=DEV),
            torch.tensor(qsl, dtype=torch.int32, device=DEV),
            torch.tensor(lens, dtype=torch.int32, device=DEV), bt.to(DEV),
            max(b - a for a, b in zip(qsl, qsl[1:], strict=False)), max(lens), qsl, lens,
        )
        logits = model(torch.tensor([ids], device=DEV), use_cache=False,
                       position_ids=torch.tensor([pos], device=DEV)).logits[0]
        for r, i in enumerate(rows):
            done[i] = lens[r]
            if done[i] == len(toks[i]):
                toks[i].append(int(logits[qsl[r + 1] - 1].argmax()))
    got = [t[len(p):] for t, p in zip(toks, prompts, strict=True)]
    for g, w in zip(got, want, strict=True):
        print(f"  paged {g}\n  hf    {w}")
    assert got == want, "greedy tokens differ from transformers"


def check_engine(n_new: int = 12) -> None:
    try:
        from pagellm import LLM, SamplingParams
    except Exception as e:  # the engine is being written concurrently
        print(f"  SKIPPED engine: pagellm.LLM not importable ({e!r})")
        return
    cfg, model = tiny_llama()
    lens = (90, 7, 40, 3, 25, 61)
    prompts = [[(5 * i + 11 * j) % 500 + 1 for j in range(n)] for i, n in enumerate(lens)]
    # Different lengths: decode steps of 6, 5, .., 1 sequences (padded and exact buckets).
    news = [n_new - 2 * i for i in range(len(prompts))]
    want = [hf_greedy(model, p, n) for p, n in zip(prompts, news, strict=True)]
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        save_word_tokenizer(tmp, cfg.vocab_size)
        for eager in (False, True):
            try:
                llm = LLM(model=tmp, device=DEV, dtype="float32", attention_backend="triton",
                          max_num_batched_tokens=32, max_num_seqs=8, gpu_memory_utilization=0.3,
                          enforce_eager=eager)
            except Exception as e:
                print(f"  SKIPPED engine: could not build pagellm.LLM ({e!r})")
                return
            params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                      for n in news]
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                use_tqdm=False)
            got = [o.outputs[0].token_ids for o in outs]
            graphs = llm.llm_engine.engine_core.executor.runner.graph_runner
            mode = "eager " if eager else "graphs"
            used = "" if graphs is None else f" (graph steps per bucket {dict(graphs.num_steps)})"
            print(f"  engine {mode} {got}{used}\n  hf            {want}")
            assert got == want, f"engine ({mode}) greedy tokens differ from transformers"
            assert (graphs is None) == eager, "CUDA graphs on/off does not follow enforce_eager"
            if graphs is not None:
                assert len(graphs.num_steps) >= 3, "decode steps did not run on the graphs"
            llm.llm_engine.shutdown()
            del llm


def _bench_decode(batch: int, ctx: int, peak: float | None) -> str:
    import torch.nn.functional as F
    import triton

    hq, hkv, d, bs, dtype = 32, 8, 128, 16, torch.bfloat16
    nb = batch * ctx // bs
    kc = torch.randn(nb, bs, hkv, d, device=DEV, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.randperm(nb, device=DEV).int().view(batch, ctx // bs)  # scattered blocks
    q = torch.randn(batch, hq, d, device=DEV, dtype=dtype)
    qsl = torch.arange(batch + 1, device=DEV, dtype=torch.int32)
    lens = torch.full((batch,), ctx, device=DEV, dtype=torch.int32)
    gb = 2 * batch * ctx * hkv * d * 2 / 1e9
    line = f"  batch={batch:3d} ctx={ctx:5d} KV={gb:6.2f} GB"
    auto = choose_num_segments(batch, hkv, ctx, _num_sms(q.device), True)
    for segs in sorted({1, auto}):
        out = torch.empty_like(q)
        ms = triton.testing.do_bench(lambda s=segs, o=out: paged_attention(
            q, kc, vc, o, qsl, lens, bt, batch, 1, d**-0.5, num_segments=s))
        pct = f" ({100 * gb / ms * 1e3 / peak:4.1f}% peak)" if peak else ""
        line += f" | segs={segs:2d} {ms * 1e3:8.1f} us {gb / ms * 1e3:7.0f} GB/s{pct}"
    kd = kc.view(batch, ctx, hkv, d).transpose(1, 2)  # dense stand-in: same bytes, no paging
    vd = vc.view(batch, ctx, hkv, d).transpose(1, 2)
    ms = triton.testing.do_bench(
        lambda: F.scaled_dot_product_attention(q[:, :, None], kd, vd, enable_gqa=True))
    return line + f" | sdpa-dense {ms * 1e3:8.1f} us {gb / ms * 1e3:7.0f} GB/s"


def check_bench() -> None:
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_GBPS.items() if k in name), None)
    print(f"  {name}; decode, Hq=32 Hkv=8 D=128 block=16 bf16; HBM peak {peak} GB/s")
    for batch in (1, 16, 128):
        for ctx in (1024, 8192):
            print(_bench_decode(batch, ctx, peak), flush=True)


CHECKS = {"tests": check_tests, "sweep": check_sweep, "paged": check_paged,
          "engine": check_engine, "bench": check_bench, "throughput": check_throughput,
          "ops": check_ops, "moe": check_moe}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default=",".join(CHECKS), help="comma list of " + ",".join(CHECKS))
    ap.add_argument("--device", default="cuda",
                    help="cpu: a smoke run of the script itself under TRITON_INTERPRET=1")
    ap.add_argument("--throughput-worker", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    global DEV
    DEV = gpu_check_ops.DEV = gpu_check_throughput.DEV = args.device
    if args.throughput_worker:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(levelname)s] %(message)s")
        result = throughput_worker(json.loads(args.throughput_worker))
        print("THROUGHPUT_JSON " + json.dumps(result))
        return 0
    names = args.only.split(",")
    for name in names:
        if name not in CHECKS:
            ap.error(f"--only: unknown check {name!r}; choose from {', '.join(CHECKS)}")
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    if TRITON_MISSING is not None:
        print(f"gpu_check needs triton: {TRITON_MISSING}; every check skipped.")
        return 2
    if DEV == "cuda" and (not torch.cuda.is_available() or interpreted):
        print("gpu_check needs a CUDA device and TRITON_INTERPRET unset; every check skipped "
              "(--device cpu with TRITON_INTERPRET=1 smoke-runs the kernel checks).")
        return 2
    if DEV == "cpu" and not interpreted:
        print("--device cpu needs TRITON_INTERPRET=1 (set before python starts).")
        return 2
    failed = []
    for name in names:
        if DEV == "cpu" and name in ("bench", "throughput"):
            print(f"== {name}: SKIPPED (CUDA only: it times kernels and CUDA graphs)")
            continue
        print(f"== {name}", flush=True)
        try:
            CHECKS[name]()
            print(f"== {name}: ok", flush=True)
        except Exception:
            traceback.print_exc()
            failed.append(name)
            print(f"== {name}: FAILED", flush=True)
    print("ALL OK" if not failed else f"FAILED: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
