//! `fp4moe bench`: per batch size, the median time of the whole layer (routing included), the
//! NVFP4 memory floor and the bf16 compute floor of DESIGN 5, time/floor and useful TFLOP/s.
//! CUDA: graph replays timed with events, rotating inputs and weight copies (see
//! `fp4moe::cuda::bench`); the memory floor from the device's copy bandwidth. CPU and
//! reference: wall-clock median of routing plus forward after one warm-up, the inputs
//! rotating; the memory floor from this host's copy bandwidth, and no compute floor (DESIGN 5's
//! is the H200's bf16 rate, which says nothing of a CPU), so time/floor is against memory.

use crate::progress::step;
use crate::{BackendArg, PresetArg};
use anyhow::{bail, Context, Result};
use fp4moe::calibration::calibrate_with_router;
use fp4moe::routing::{route, router_logits};
use fp4moe::spec::{Intermediate, MoeSpec, QuantMode};
use fp4moe::synthetic::{random_tokens, random_weights, Preset};
use fp4moe::weights::MoeWeights;
use fp4moe::{Backend, BackendChoice, MoeLayer, Workspace};
use std::path::PathBuf;
use std::time::Instant;

/// H200 bf16 dense matmul rate measured for DESIGN 5 (788–795 TFLOP/s).
const BF16_TFLOPS: f64 = 790.0;

#[derive(Clone, Copy, Debug, clap::ValueEnum)]
pub(crate) enum ModeArg {
    W4a16,
    W4a4,
}

/// Distinct experts the tokens route to, averaged over the input sets.
fn experts_touched(spec: &MoeSpec, w: &MoeWeights, inputs: &[Vec<f32>]) -> f64 {
    let e = spec.shape.experts;
    let total: usize = inputs
        .iter()
        .map(|x| {
            let l = router_logits(x, w.router.as_deref().unwrap_or(&[]), spec.shape.hidden, e);
            let t = route(&l, e, &spec.routing, w.e_score_correction_bias.as_deref());
            let mut seen = vec![false; e];
            t.ids.iter().for_each(|&i| seen[i as usize] = true);
            seen.iter().filter(|&&s| s).count()
        })
        .sum();
    total as f64 / inputs.len().max(1) as f64
}

/// Times (µs) under their names: one printed line of "name text" items (`text` formats a
/// value) and the JSON object name → µs.
fn named_us(
    names: &[&str],
    values: &[f64],
    text: impl Fn(f64) -> String,
) -> (String, serde_json::Value) {
    let line: Vec<String> = names
        .iter()
        .zip(values)
        .map(|(n, &v)| format!("{n} {}", text(v)))
        .collect();
    let map: serde_json::Map<String, serde_json::Value> = names
        .iter()
        .zip(values)
        .map(|(n, &v)| (n.to_string(), serde_json::json!(v)))
        .collect();
    (line.join(", "), serde_json::Value::Object(map))
}

/// `fp4moe bench`'s arguments.
#[derive(clap::Args, Debug)]
pub(crate) struct Args {
    #[arg(long, value_enum, default_value = "nemotron3-nano")]
    pub preset: PresetArg,
    /// Batch sizes.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,8,64,256,1024,4096,16384"
    )]
    pub tokens: Vec<usize>,
    #[arg(long, value_enum, default_value = "w4a16")]
    pub mode: ModeArg,
    #[arg(long, value_enum, default_value = "auto")]
    pub backend: BackendArg,
    /// Also write the results as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Timed runs per batch size: CUDA graph replays, at least (default 200, 40 from 1024
    /// tokens; whole rounds of the input sets and weight copies, and as many more as
    /// `--min-time-ms` needs); CPU and reference forwards, routing included (default 4).
    #[arg(long)]
    pub iterations: Option<usize>,
    /// CUDA: GPU time (ms) of untimed replays before the timed ones. Under a sustained prefill
    /// the H200 reaches its power cap within ~100 ms and slows its clock by ~10 %; the default
    /// times that steady state. 0: three warm-up rounds only (the boost clock, mostly).
    #[arg(long, default_value_t = 300.0)]
    pub warmup_ms: f64,
    /// CUDA: the first sizes' warm-up lasts until this many ms of GPU time have been replayed
    /// in all: from idle the H200 reaches its power cap ~0.8 s into a sustained load, and its
    /// clock dips hardest right then. 0: no such wait.
    #[arg(long, default_value_t = 1500.0)]
    pub settle_ms: f64,
    /// CUDA: the timed replays of a size last at least this many ms of GPU time (and
    /// `--iterations` replays): under the power cap the clock dips about once a second for
    /// ~0.2–0.3 s, and a short window that falls into a dip times 4–10 % high. 0: the
    /// iterations alone.
    #[arg(long, default_value_t = 1000.0)]
    pub min_time_ms: f64,
    /// CUDA: also time each stage (routing, GEMM1, GEMM2, combine): what it adds to a
    /// replay of the layer cut after it (graphs of each prefix, timed after every size's
    /// whole layer).
    #[arg(long)]
    pub stages: bool,
    /// CUDA: also time the bare-read yardstick (`bare_read.cu`): the touched experts' weight
    /// bytes read once with nothing computed, alone, after the layer's own routing, and after
    /// it as two dependent reads (w13's, then w2's); timed after every size's whole layer, like
    /// --stages.
    #[arg(long)]
    pub bare_reads: bool,
    /// Input sets rotated between runs, each on its own workspace. 1 times the layer as a
    /// model runs it: every replay on one workspace and input, left in L2 by the previous
    /// replay as by the previous layer (the weights still alternate between two copies).
    #[arg(long, default_value_t = 4)]
    pub inputs: usize,
    /// Also draw time/floor against tokens as SVG: this run plus any --compare documents.
    #[arg(long)]
    pub plot: Option<PathBuf>,
    /// Benchmark JSON files (earlier `bench --json`, the PyTorch peer's) drawn beside this run.
    #[arg(long, value_delimiter = ',')]
    pub compare: Vec<PathBuf>,
}

pub(crate) fn run(a: Args) -> Result<()> {
    if a.tokens.is_empty() || a.tokens.contains(&0) {
        bail!("--tokens must list batch sizes of at least 1");
    }
    if a.inputs == 0 {
        bail!("--inputs must be at least 1");
    }
    for (flag, ms) in [
        ("--warmup-ms", a.warmup_ms),
        ("--settle-ms", a.settle_ms),
        ("--min-time-ms", a.min_time_ms),
    ] {
        if !(ms.is_finite() && ms >= 0.0) {
            bail!("{flag} must be a number of milliseconds >= 0, not {ms}");
        }
    }
    let p = Preset::from(a.preset);
    let quant = match a.mode {
        ModeArg::W4a16 => QuantMode::W4A16,
        ModeArg::W4a4 => QuantMode::W4A4 {
            intermediate: Intermediate::Static,
        },
    };
    let spec = p.spec(quant);
    let backend = match a.backend {
        BackendArg::Auto => fp4moe::backend::select(&Backend::AUTO_ORDER, &spec)?,
        BackendArg::Cuda => Backend::Cuda,
        BackendArg::Cpu => Backend::Cpu,
        BackendArg::Reference => Backend::Reference,
    };
    fp4moe::backend::require(backend, &spec)?;
    for (flag, on) in [("--stages", a.stages), ("--bare-reads", a.bare_reads)] {
        if on && backend != Backend::Cuda {
            bail!("{flag} times CUDA graphs: it needs --backend cuda (or auto on a GPU machine)");
        }
    }
    let mut w = step("quantizing random bf16 weights (ModelOpt recipe)", || {
        random_weights(&spec, a.seed)
    })?;
    if let QuantMode::W4A4 { .. } = quant {
        let calib = random_tokens(16, spec.shape.hidden, a.seed ^ 0xCA1);
        step("calibrating input scales on 16 tokens", || {
            calibrate_with_router(&spec, &mut w, &calib)
        })?;
    }
    let (sh, i, e, k) = (
        spec.shape.hidden,
        spec.shape.intermediate,
        spec.shape.experts,
        spec.routing.top_k,
    );
    let per_expert_weights = (spec.activation.w13_shards() * i * sh + sh * i) as f64;
    let expert_bytes = (w.w13.expert_bytes() + w.w2.expert_bytes()) as f64;

    let (bandwidth, device) = match backend {
        Backend::Cuda => {
            let d = fp4moe::cuda::device()?;
            (
                step(
                    "measuring device copy bandwidth",
                    fp4moe::cuda::bench::copy_bandwidth,
                )?,
                format!(
                    "{} (sm {}.{})",
                    d.name, d.compute_capability.0, d.compute_capability.1
                ),
            )
        }
        _ => (
            step("measuring host copy bandwidth", crate::host::copy_bandwidth),
            format!("CPU, {} threads", rayon::current_num_threads()),
        ),
    };
    // The compute floor is the H200's bf16 rate (DESIGN 5): a floor for the GPU only.
    let host = backend != Backend::Cuda;
    let tflops_floor = (!host).then_some(BF16_TFLOPS);
    println!(
        "fp4moe bench: {} {} on {} [{}], copy bandwidth {:.*} GB/s (read+write), {}{}",
        p.name(),
        spec.quant,
        backend,
        device,
        usize::from(host),
        bandwidth / 1e9,
        match tflops_floor {
            Some(r) => format!("bf16 compute {r} TFLOP/s (DESIGN 5)"),
            None => "no compute floor (DESIGN 5's bf16 rate is the H200's)".to_string(),
        },
        if host {
            String::new()
        } else {
            format!(
                ", timed after {} ms of warm-up ({} ms in all first), over {} ms at least, {} input set{}",
                a.warmup_ms,
                a.settle_ms,
                a.min_time_ms,
                a.inputs,
                if a.inputs == 1 {
                    " (one workspace)"
                } else {
                    "s"
                }
            )
        }
    );
    println!(
        "{:>6} {:>11} {:>11} {:>8} {:>13} {:>14} {:>11} {:>9}",
        "tokens",
        "median µs",
        "min µs",
        "experts",
        "mem floor µs",
        "comp floor µs",
        "time/floor",
        "TFLOP/s"
    );
    let mut rows: Vec<serde_json::Value> = Vec::new();
    // The input sets of a batch size (the same ones whenever asked).
    let make_inputs = |t: usize| -> Vec<Vec<f32>> {
        (0..a.inputs as u64)
            .map(|r| random_tokens(t, sh, a.seed + 100 * t as u64 + r))
            .collect()
    };
    // Sizes whose stages are timed after the loop: (row, tokens, plan, whole-layer median).
    let mut staged = Vec::new();
    // Sizes whose bare reads are timed after the loop: (row, tokens, plan, memory floor).
    let mut bare = Vec::new();
    // Two weight copies, built at the first size and timed at every size.
    let mut cuda_layers = None;
    for &t in &a.tokens {
        let inputs = make_inputs(t);
        let touched = experts_touched(&spec, &w, &inputs);
        let mem_floor = touched * expert_bytes / bandwidth * 1e6;
        let (median, min) = match backend {
            Backend::Cuda => {
                let iters = a
                    .iterations
                    .unwrap_or(if t >= 1024 { 40 } else { 200 })
                    .max(1);
                let layers = match &mut cuda_layers {
                    Some(l) => l,
                    None => cuda_layers
                        .insert(step("packing and uploading two weight copies", || {
                            fp4moe::cuda::bench::BenchLayers::new(&spec, &w, 2)
                        })?),
                };
                let plan = fp4moe::cuda::bench::TimingPlan {
                    iterations: iters,
                    warmup_ms: a.warmup_ms,
                    settle_ms: a.settle_ms,
                    min_time_ms: a.min_time_ms,
                };
                let tm = step(&format!("timing {t} tokens"), || layers.time(&inputs, plan))
                    .with_context(|| format!("{t} tokens"))?;
                if a.stages {
                    staged.push((rows.len(), t, plan, tm.median_us));
                }
                if a.bare_reads {
                    bare.push((rows.len(), t, plan, mem_floor));
                }
                (tm.median_us, tm.min_us)
            }
            other => {
                let layer = MoeLayer::new(spec, w.clone(), BackendChoice::Use(other))?;
                // No spinner: its ticking thread would share the cores being timed.
                let iters = a.iterations.unwrap_or(4).max(1);
                host_times(&layer, &inputs, iters).with_context(|| format!("{t} tokens"))?
            }
        };
        let flops = 2.0 * t as f64 * k as f64 * per_expert_weights;
        let comp_floor = tflops_floor.map(|r| flops / (r * 1e12) * 1e6);
        let floor = comp_floor.map_or(mem_floor, |c| mem_floor.max(c));
        let tflops = flops / (median * 1e-6) / 1e12;
        let comp_text = comp_floor.map_or("—".to_string(), |c| format!("{c:.1}"));
        println!(
            "{t:>6} {median:>11.1} {min:>11.1} {touched:>8.1} {mem_floor:>13.1} {comp_text:>14} {:>10.2}x {tflops:>9.prec$}",
            median / floor,
            prec = if host { 3 } else { 1 }
        );
        let row = serde_json::json!({
            "tokens": t, "median_us": median, "min_us": min, "experts_touched": touched,
            "memory_floor_us": mem_floor, "compute_floor_us": comp_floor, "time_over_floor": median / floor,
            "useful_tflops": tflops,
        });
        rows.push(row);
    }
    // Stage times after every size's whole layer (`BenchLayers::stages` says why).
    if let (Some(layers), false) = (&mut cuda_layers, staged.is_empty()) {
        println!(
            "stages µs (graph prefixes: what each adds to a replay of the layer cut after it)"
        );
        for (i, t, plan, whole) in staged {
            let inputs = make_inputs(t);
            let st = step(&format!("timing the stages at {t} tokens"), || {
                layers.stages(&inputs, plan, whole)
            })
            .with_context(|| format!("{t} tokens, stages"))?;
            let (line, json) = named_us(&fp4moe::cuda::STAGES, &st, |v| format!("{v:.1}"));
            println!("{t:>6} {line}");
            rows[i]["stages_us"] = json;
        }
    }
    // The yardstick after every size's whole layer, as the stages.
    if let (Some(layers), false) = (&mut cuda_layers, bare.is_empty()) {
        println!(
            "bare reads µs (the touched experts' weight bytes read once, nothing computed; x memory floor)"
        );
        for (i, t, plan, floor) in bare {
            let inputs = make_inputs(t);
            let us = step(&format!("timing the bare reads at {t} tokens"), || {
                layers.bare_reads(&inputs, plan)
            })
            .with_context(|| format!("{t} tokens, bare reads"))?;
            let modes = fp4moe::cuda::BareRead::ALL;
            let text = |v: f64| format!("{v:.1} ({:.2}x)", v / floor);
            let (line, _) = named_us(&modes.map(|m| m.name()), &us, text);
            println!("{t:>6} {line}");
            rows[i]["bare_read_us"] = named_us(&modes.map(|m| m.key()), &us, text).1;
        }
    }
    let doc = serde_json::json!({
        "preset": p.name(), "mode": spec.quant.to_string(), "backend": backend.name(), "device": device,
        "copy_bandwidth_gbs": bandwidth / 1e9, "bf16_tflops": tflops_floor, "experts": e, "top_k": k,
        "warmup_ms": (backend == Backend::Cuda).then_some(a.warmup_ms),
        "settle_ms": (backend == Backend::Cuda).then_some(a.settle_ms),
        "min_time_ms": (backend == Backend::Cuda).then_some(a.min_time_ms), "inputs": a.inputs, "results": rows,
    });
    if let Some(path) = &a.json {
        let text = serde_json::to_string_pretty(&doc)?;
        fp4moe::tensor_io::write_atomic(path, text.as_bytes())?;
    }
    if let Some(path) = &a.plot {
        let mut docs = vec![("this run".to_string(), doc)];
        docs.extend(crate::plot::read_docs(&a.compare)?);
        let (name, lines) = crate::plot::series(&docs)?;
        let svg = crate::plot::svg(&format!("{name} on {device}"), &lines);
        fp4moe::tensor_io::write_atomic(path, svg.as_bytes())?;
    }
    Ok(())
}

/// Wall-clock (median, min) µs of routing plus forward on a host backend, after one warm-up
/// run (rayon's threads, first-touch pages of the workspace) on the first input; the timed runs
/// start from the second input, so none repeats the batch just run while its experts are still
/// in the caches.
fn host_times(layer: &MoeLayer, inputs: &[Vec<f32>], iters: usize) -> Result<(f64, f64)> {
    let mut ws = Workspace::default();
    let mut out = Vec::new();
    let mut once = |x: &[f32]| -> Result<f64> {
        out.resize(x.len(), 0.0);
        let t0 = Instant::now();
        let topk = layer.route(x, None)?;
        layer.forward(x, &topk, &mut out, &mut ws)?;
        Ok(t0.elapsed().as_secs_f64() * 1e6)
    };
    let Some(first) = inputs.first() else {
        bail!("no inputs to time");
    };
    once(first)?;
    let mut times = (0..iters)
        .map(|i| once(&inputs[(i + 1) % inputs.len()]))
        .collect::<Result<Vec<f64>>>()?;
    times.sort_by(f64::total_cmp);
    Ok((times[times.len() / 2], times[0]))
}
