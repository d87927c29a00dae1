#!/usr/bin/env python3
"""PyTorch bf16 baseline for `fp4moe bench`: the same presets and batch sizes, the MoE layer as
routing + token sort + two `torch._grouped_mm` calls + activation + weighted scatter, captured in
a CUDA graph and timed with CUDA events (median of replays after warm-up, rotating inputs).
Prints the same table as `fp4moe bench` (floors from DESIGN 5: bf16 weights are 16 bits/weight,
so its memory floor is 3.6x the NVFP4 one).

usage: python3 benches/peers/torch_moe.py --preset nemotron3-nano --tokens 1,8,64,256,1024,4096,16384 [--json PATH]
"""
import argparse
import json
import math

import torch

PRESETS = {
    # name: (hidden, inter, experts, top_k, gated, scoring, renormalize, rsf)
    "nemotron3-nano": (2688, 1856, 128, 6, False, "sigmoid", True, 2.5),
    "qwen3-30b-a3b": (2048, 768, 128, 8, True, "softmax", True, 1.0),
}
BF16_TFLOPS = 790.0


def build(preset, device):
    h, i, e, k, gated, scoring, renorm, rsf = PRESETS[preset]
    g = torch.Generator(device=device).manual_seed(0)
    s = 2 if gated else 1
    w13 = (torch.randn(e, s * i, h, generator=g, device=device) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, generator=g, device=device) / i**0.5).to(torch.bfloat16)
    router = (torch.randn(e, h, generator=g, device=device) / h**0.5).float()
    bias = (0.05 * torch.randn(e, generator=g, device=device)) if scoring == "sigmoid" else None
    return dict(h=h, i=i, e=e, k=k, gated=gated, scoring=scoring, renorm=renorm, rsf=rsf,
                w13=w13, w2=w2, router=router, bias=bias)


def moe(m, x):
    t = x.shape[0]
    logits = x.float() @ m["router"].T
    scores = torch.sigmoid(logits) if m["scoring"] == "sigmoid" else torch.softmax(logits, -1)
    sel = scores + m["bias"] if m["bias"] is not None else scores
    ids = torch.topk(sel, m["k"], dim=-1).indices
    w = torch.gather(scores, 1, ids)
    if m["renorm"]:
        w = w / w.sum(-1, keepdim=True)
    w = w * m["rsf"]
    flat = ids.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(m["e"], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    tok = order // m["k"]
    xs = x[tok]
    hdn = torch._grouped_mm(xs, m["w13"].transpose(-2, -1), offs=offs)
    if m["gated"]:
        gate, up = hdn.chunk(2, dim=-1)
        act = torch.nn.functional.silu(gate) * up
    else:
        act = torch.relu(hdn).square()
    o = torch._grouped_mm(act, m["w2"].transpose(-2, -1), offs=offs)
    o = o.float() * w.flatten()[order].unsqueeze(1)
    y = torch.zeros(t, m["h"], dtype=torch.float32, device=x.device)
    y.index_add_(0, tok, o)
    return y


def bench(m, t, iters, warmup_ms, settle_ms, min_time_ms, busy, device):
    """Median and min µs of the layer's graph replays at t tokens over four rotating inputs."""
    xs = [torch.randn(t, m["h"], device=device).to(torch.bfloat16) for _ in range(4)]
    static_x = xs[0].clone()
    graph = graph_of(lambda: moe(m, static_x))
    items = [(lambda x=x: static_x.copy_(x), graph) for x in xs]
    return time_replays(items, iters, warmup_ms, settle_ms, min_time_ms, busy)


def graph_of(fn):
    """fn() captured in a CUDA graph after three eager runs."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def time_replays(items, iters, warmup_ms, settle_ms, min_time_ms, busy):
    """Median and min µs of graph replays, timed as `fp4moe bench` times them. items: (prepare,
    graph) pairs replayed in turn, prepare (untimed; None for nothing) before its graph. A
    warm-up of warmup_ms (and until busy[0], the GPU ms replayed so far, reaches settle_ms),
    then whole rounds of the items for at least iters replays and min_time_ms."""

    def replay(item):
        prepare, graph = item
        if prepare is not None:
            prepare()
        return graph

    # Untimed replays for at least warmup_ms of GPU time, as `fp4moe bench --warmup-ms`: under a
    # sustained load the H200 reaches its power cap within ~100 ms and lowers its clock; from
    # idle its clock dips hardest ~0.8 s in (`--settle-ms`).
    start = torch.cuda.Event(enable_timing=True)
    start.record()
    replays = 0
    target = max(warmup_ms, settle_ms - busy[0])
    while True:
        for item in items:
            replay(item).replay()
        replays += len(items)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        warmed = start.elapsed_time(end)
        if warmed >= target:
            break
    # Whole rounds for at least min_time_ms: the clock dips about once a second under the cap.
    n = max(iters, math.ceil(min_time_ms / (warmed / replays)))
    n = -(-n // len(items)) * len(items)
    times = []
    for it in range(n + 10):
        graph = replay(items[it % len(items)])
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        if it >= 10:
            times.append((s, e))
    torch.cuda.synchronize()
    us = sorted(s.elapsed_time(e) * 1e3 for s, e in times)
    busy[0] += warmed + sum(us) / 1e3
    return us[len(us) // 2], us[0]


def best_seconds(fn, runs):
    """Shortest of `runs` eager runs of fn(), each timed alone by CUDA events."""
    best = 1e9
    for _ in range(runs):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        best = min(best, s.elapsed_time(e) * 1e-3)
    return best


def copy_bandwidth(device):
    a = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * a.numel() / best_seconds(lambda: b.copy_(a), 6)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="nemotron3-nano", choices=sorted(PRESETS))
    ap.add_argument("--tokens", default="1,8,64,256,1024,4096,16384")
    ap.add_argument("--json")
    ap.add_argument("--warmup-ms", type=float, default=300.0,
                    help="GPU time of untimed replays before the timed ones (fp4moe bench's default)")
    ap.add_argument("--settle-ms", type=float, default=1500.0,
                    help="the first sizes' warm-up lasts until this much GPU time was replayed in all")
    ap.add_argument("--min-time-ms", type=float, default=1000.0,
                    help="GPU time the timed replays of a size last at least")
    a = ap.parse_args()
    device = "cuda"
    m = build(a.preset, device)
    bw = copy_bandwidth(device)
    s = 2 if m["gated"] else 1
    per_expert = s * m["i"] * m["h"] + m["h"] * m["i"]
    print(f"torch bf16 _grouped_mm + CUDA graph: {a.preset} on {torch.cuda.get_device_name()}, "
          f"copy bandwidth {bw / 1e9:.0f} GB/s, torch {torch.__version__}, "
          f"timed after {a.warmup_ms:g} ms of warm-up ({a.settle_ms:g} ms in all first), "
          f"over {a.min_time_ms:g} ms at least")
    print(f"{'tokens':>6} {'median µs':>11} {'min µs':>11} {'experts':>8} {'mem floor µs':>13} "
          f"{'comp floor µs':>14} {'time/floor':>11} {'TFLOP/s':>9}")
    rows = []
    busy = [0.0]
    for t in [int(v) for v in a.tokens.split(",")]:
        med, mn = bench(m, t, 40 if t >= 1024 else 200, a.warmup_ms, a.settle_ms, a.min_time_ms, busy, device)
        x = torch.randn(t, m["h"], device=device).to(torch.bfloat16)
        logits = x.float() @ m["router"].T
        sc = torch.sigmoid(logits) if m["scoring"] == "sigmoid" else torch.softmax(logits, -1)
        sel = sc + m["bias"] if m["bias"] is not None else sc
        touched = torch.unique(torch.topk(sel, m["k"], -1).indices).numel()
        mem_floor = touched * per_expert * 2 / bw * 1e6
        flops = 2 * t * m["k"] * per_expert
        comp_floor = flops / (BF16_TFLOPS * 1e12) * 1e6
        floor = max(mem_floor, comp_floor)
        tfl = flops / (med * 1e-6) / 1e12
        print(f"{t:>6} {med:>11.1f} {mn:>11.1f} {touched:>8} {mem_floor:>13.1f} {comp_floor:>14.1f} "
              f"{med / floor:>10.2f}x {tfl:>9.1f}")
        rows.append(dict(tokens=t, median_us=med, min_us=mn, experts_touched=touched,
                         memory_floor_us=mem_floor, compute_floor_us=comp_floor, useful_tflops=tfl))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(preset=a.preset, backend="torch-bf16-grouped_mm-graph", warmup_ms=a.warmup_ms,
                           settle_ms=a.settle_ms, min_time_ms=a.min_time_ms, results=rows), f, indent=1)


if __name__ == "__main__":
    main()
