#!/usr/bin/env python3
"""What the card itself reaches on the layer's two kinds of work, timed as `fp4moe bench` times
(CUDA graphs, the same warm-up and settle rules: `torch_moe.time_replays`): the yardsticks for
DESIGN 5's floors.

- compute (sizes whose T·k pairs split evenly over the experts): the two expert GEMMs in bf16
  through cuBLAS with the layer's FLOPs and nothing else (no routing, grouping, activation or
  combine). dense: all T·k pairs as one matrix, [T·k, H] x [H, S·I], then [T·k, I] x [I, H]
  (one weight matrix, cuBLAS's best case for these FLOPs); batched: perfectly balanced experts,
  `torch.bmm` over E experts of T·k / E rows with every expert's own weights. Beside them an
  8192³ product: best of ten after three warm-ups (DESIGN 5's 790 TFLOP/s protocol, ~15 ms at
  the boost clock) and sustained.
- memory (every size): the NVFP4 bytes of the experts uniform routing touches on average
  (E·(1 - (1 - k/E)^T), rounded), read by f32 sums in one graph (the bits as f32: a sum
  runs at the read rate whatever they hold; int32 sums run at a fifth of it): one sum over every
  touched expert's w13 and w2 bytes, and two dependent ones (w13's, then w2's, as GEMM1 and
  GEMM2 read them). Two weight copies alternate, as in `fp4moe bench`, so the bytes come from
  DRAM wherever both copies' touched experts together exceed L2 (not at one token: 2 x 21 MB
  for Qwen3-30B-A3B, where the one-token row bounds nothing anyway).

usage: python3 benches/peers/yardsticks.py --preset nemotron3-nano --tokens 1,8,64,256,1024,4096,16384 [--json PATH]
"""
import argparse
import json

import torch

from torch_moe import BF16_TFLOPS, PRESETS, best_seconds, copy_bandwidth, graph_of, time_replays


def square_rate(device, busy, a):
    """TFLOP/s of an 8192³ bf16 product: best of ten after three warm-ups, and sustained."""
    n = 8192
    x = torch.randn(n, n, device=device).to(torch.bfloat16)
    w = torch.randn(n, n, device=device).to(torch.bfloat16)
    for _ in range(3):
        x @ w
    torch.cuda.synchronize()
    best = best_seconds(lambda: x @ w, 10)
    med, _ = time_replays([(None, graph_of(lambda: x @ w))], 20, a.warmup_ms, a.settle_ms, a.min_time_ms, busy)
    flops = 2 * n**3
    return flops / best / 1e12, flops / (med * 1e-6) / 1e12


def compute_rows(a, device, busy, dims):
    h, i, e, k, s = dims
    g = torch.Generator(device=device).manual_seed(0)
    w13 = (torch.randn(e, h, s * i, generator=g, device=device) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, i, h, generator=g, device=device) / i**0.5).to(torch.bfloat16)
    print(f"{'tokens':>6} {'comp floor µs':>14} {'dense µs':>10} {'x floor':>8} {'TFLOP/s':>8} "
          f"{'batched µs':>11} {'x floor':>8} {'TFLOP/s':>8}")
    rows = []
    for t in a.tokens:
        pairs = t * k
        if pairs % e:
            continue
        m = pairs // e
        flops = 2 * pairs * (s * i * h + h * i)
        floor = flops / (BF16_TFLOPS * 1e12) * 1e6
        xs = [torch.randn(pairs, h, device=device).to(torch.bfloat16) for _ in range(2)]
        x = xs[0].clone()
        # The second GEMM's input is the first's output cut to I columns (gated: the gate half),
        # so both products stay in one graph.
        dense_g = graph_of(lambda: x.matmul(w13[0])[:, :i].matmul(w2[0]))
        batched_g = graph_of(lambda: torch.bmm(torch.bmm(x.view(e, m, h), w13)[:, :, :i], w2))
        times = []
        for graph in (dense_g, batched_g):
            times.append(time_replays([(lambda v=v: x.copy_(v), graph) for v in xs], 40,
                                      a.warmup_ms, a.settle_ms, a.min_time_ms, busy)[0])
        dense, batched = times
        print(f"{t:>6} {floor:>14.1f} {dense:>10.1f} {dense / floor:>7.2f}x {flops / dense / 1e6:>8.1f} "
              f"{batched:>11.1f} {batched / floor:>7.2f}x {flops / batched / 1e6:>8.1f}")
        rows.append(dict(tokens=t, compute_floor_us=floor, dense_us=dense, batched_us=batched, rows_per_expert=m))
        del xs, x, dense_g, batched_g
    del w13, w2
    torch.cuda.empty_cache()
    return rows


def memory_rows(a, device, busy, dims):
    h, i, e, k, s = dims
    w13_bytes = s * i * h * 9 // 16  # 4-bit values and one E4M3 scale per 16 weights
    per_expert = w13_bytes + h * i * 9 // 16
    assert w13_bytes % 4 == 0 and per_expert % 4 == 0
    bw = copy_bandwidth(device)
    def weights(cols):
        return [torch.randint(0, 256, (e, cols), dtype=torch.uint8, device=device) for _ in range(2)]

    # One buffer of whole experts per copy for the one read; w13 and w2 apart for the two.
    whole, w13s, w2s = weights(per_expert), weights(w13_bytes), weights(per_expert - w13_bytes)
    big = whole[0].view(torch.float32)
    read_us = time_replays([(None, graph_of(lambda: big.sum()))], 20, a.warmup_ms, a.settle_ms, a.min_time_ms, busy)[0]
    print(f"copy bandwidth {bw / 1e9:.0f} GB/s (read+write, as `fp4moe bench` measures it); "
          f"an f32 sum of all {e} experts ({big.numel() * 4 / 1e6:.0f} MB) reads at {big.numel() * 4 / read_us / 1e3:.0f} GB/s")
    print(f"{'tokens':>6} {'experts':>8} {'mem floor µs':>13} {'one read µs':>12} {'x floor':>8} "
          f"{'two reads µs':>13} {'x floor':>8}")
    rows = []
    for t in a.tokens:
        n = max(1, round(e * (1 - (1 - k / e) ** t)))
        floor = n * per_expert / bw * 1e6
        out = torch.zeros(2, dtype=torch.float32, device=device)

        def one(c):
            return lambda: out[0].copy_(whole[c][:n].view(torch.float32).sum())

        def two(c):
            def f():
                out[0].copy_(w13s[c][:n].view(torch.float32).sum())
                out[1].copy_(w2s[c][:n].view(torch.float32).sum() + out[0])
            return f

        times = []
        for make in (one, two):
            items = [(None, graph_of(make(c))) for c in range(2)]
            times.append(time_replays(items, 200, a.warmup_ms, a.settle_ms, a.min_time_ms, busy)[0])
        one_us, two_us = times
        print(f"{t:>6} {n:>8} {floor:>13.1f} {one_us:>12.1f} {one_us / floor:>7.2f}x "
              f"{two_us:>13.1f} {two_us / floor:>7.2f}x")
        rows.append(dict(tokens=t, experts_touched=n, memory_floor_us=floor, one_read_us=one_us, two_reads_us=two_us))
    del whole, w13s, w2s, big
    torch.cuda.empty_cache()
    return rows, bw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="nemotron3-nano", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096,16384")
    ap.add_argument("--json")
    ap.add_argument("--what", default="both", choices=["both", "memory", "compute"])
    ap.add_argument("--warmup-ms", type=float, default=300.0)
    ap.add_argument("--settle-ms", type=float, default=1500.0)
    ap.add_argument("--min-time-ms", type=float, default=1000.0)
    a = ap.parse_args()
    a.tokens = [int(v) for v in a.tokens.split(",")]
    device = "cuda"
    h, i, e, k, gated, *_ = PRESETS[a.preset]
    dims = (h, i, e, k, 2 if gated else 1)
    busy = [0.0]
    print(f"yardsticks on {torch.cuda.get_device_name()}, torch {torch.__version__}: {a.preset}")
    mem, bw, comp, boost, sustained = [], None, [], None, None
    if a.what != "compute":
        mem, bw = memory_rows(a, device, busy, dims)
    if a.what != "memory":
        boost, sustained = square_rate(device, busy, a)
        print(f"cuBLAS bf16 8192^3: {boost:.0f} TFLOP/s (best of ten after three warm-ups), {sustained:.0f} sustained")
        comp = compute_rows(a, device, busy, dims)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(preset=a.preset, backend="yardsticks", copy_bandwidth_gbs=bw and bw / 1e9,
                           square_tflops_boost=boost, square_tflops_sustained=sustained,
                           warmup_ms=a.warmup_ms, settle_ms=a.settle_ms, min_time_ms=a.min_time_ms,
                           memory=mem, compute=comp), f, indent=1)


if __name__ == "__main__":
    main()
