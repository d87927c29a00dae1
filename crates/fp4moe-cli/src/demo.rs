//! `fp4moe demo`: a synthetic layer of a real model's shape, run through the best backend and
//! checked against the reference backend, with the DESIGN 5 memory floor of this machine.

use crate::progress::step;
use crate::{BackendArg, PresetArg};
use anyhow::{Context, Result};
use fp4moe::moe::relative_l2;
use fp4moe::spec::{QuantMode, Scoring};
use fp4moe::synthetic::{random_tokens, random_weights, Preset};
use fp4moe::{Backend, BackendChoice, MoeLayer, Workspace};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn fmt_time(d: Duration) -> String {
    let s = d.as_secs_f64();
    if s >= 1.0 {
        format!("{s:.3} s")
    } else if s >= 1e-3 {
        format!("{:.2} ms", s * 1e3)
    } else {
        format!("{:.1} µs", s * 1e6)
    }
}

pub(crate) fn run(
    p: PresetArg,
    tokens: usize,
    backend: BackendArg,
    seed: u64,
    check_tokens: usize,
) -> Result<()> {
    let preset = Preset::from(p);
    let spec = preset.spec(QuantMode::W4A16);
    let s = spec.shape;
    let r = spec.routing;
    let routing = match r.scoring {
        Scoring::Sigmoid => "sigmoid + bias",
        Scoring::Softmax => "softmax",
    };
    // A backend asked for by name must fit before seconds go into quantizing the weights.
    if let BackendChoice::Use(b) = backend.choice() {
        fp4moe::backend::require(b, &spec)?;
    }
    println!(
        "fp4moe demo: {} (H {}, I {}, E {}, top-{}, {} {}, {}{}, rsf {}), {}, {} tokens, seed {}",
        preset.name(),
        s.hidden,
        s.intermediate,
        s.experts,
        r.top_k,
        spec.activation,
        if spec.activation.is_gated() {
            "gated"
        } else {
            "non-gated"
        },
        routing,
        if r.renormalize { ", renormalized" } else { "" },
        r.routed_scaling_factor,
        spec.quant,
        tokens,
        seed
    );

    let t0 = Instant::now();
    let weights = step("quantizing random bf16 weights (ModelOpt recipe)", || {
        random_weights(&spec, seed)
    })?;
    let weights = Arc::new(weights);
    println!(
        "built the layer in {}: {:.1} MB of NVFP4 expert weights",
        fmt_time(t0.elapsed()),
        (s.experts * (weights.w13.expert_bytes() + weights.w2.expert_bytes())) as f64 / 1e6
    );
    let x = random_tokens(tokens, s.hidden, seed);
    let layer = MoeLayer::new(spec, weights.clone(), backend.choice())?;
    let need = layer.workspace_bytes(tokens);
    if need > 8 << 30 {
        anyhow::bail!(
            "--tokens {tokens} needs {:.1} GB of workspace on {}; run fewer tokens",
            need as f64 / 1e9,
            layer.backend()
        );
    }
    let topk = layer.route(&x, None)?;
    let mut touched = vec![false; s.experts];
    topk.ids.iter().for_each(|&e| touched[e as usize] = true);
    let touched = touched.iter().filter(|&&t| t).count();
    let bytes = touched * (weights.w13.expert_bytes() + weights.w2.expert_bytes());

    let mut out = vec![0.0f32; tokens * s.hidden];
    let mut ws = Workspace::default();
    let mut times = Vec::new();
    step(
        &format!("running {tokens} tokens on {}", layer.backend()),
        || -> Result<()> {
            // First call grows the workspace; later calls are timed. Stop early when calls are slow.
            let warm = Instant::now();
            layer.forward(&x, &topk, &mut out, &mut ws)?;
            let warm = warm.elapsed();
            let reps = if warm > Duration::from_secs(2) { 0 } else { 3 };
            for _ in 0..reps {
                let t = Instant::now();
                layer.forward(&x, &topk, &mut out, &mut ws)?;
                times.push(t.elapsed());
            }
            if times.is_empty() {
                times.push(warm);
            }
            Ok(())
        },
    )?;
    times.sort();
    let median = times[times.len() / 2];
    anyhow::ensure!(
        out.iter().all(|v| v.is_finite()),
        "the output holds non-finite values"
    );

    let n = check_tokens.min(tokens);
    let err = if n > 0 {
        let reference = MoeLayer::new(
            spec,
            weights.clone(),
            BackendChoice::Use(Backend::Reference),
        )?;
        let xs = &x[..n * s.hidden];
        let (want, _) = step(
            &format!("checking {n} tokens against the reference backend"),
            || reference.run(xs, None),
        )
        .context("reference check")?;
        Some(relative_l2(&out[..n * s.hidden], &want))
    } else {
        None
    };

    // The floor is for the memory the backend reads its weights from.
    let (bw, machine) = if layer.backend() == Backend::Cuda {
        let d = fp4moe::cuda::device()?;
        let bw = step(
            "measuring device copy bandwidth",
            fp4moe::cuda::bench::copy_bandwidth,
        )?;
        (bw, format!("{} (time through the host API, transfers included; `fp4moe bench` times the device alone)", d.name))
    } else {
        (
            step("measuring copy bandwidth", crate::host::copy_bandwidth),
            format!("{} threads", rayon::current_num_threads()),
        )
    };
    let floor = Duration::from_secs_f64(bytes as f64 / bw);
    println!(
        "machine: {machine}, copy bandwidth {:.1} GB/s (read+write); workspace {:.1} MB",
        bw / 1e9,
        layer.workspace_bytes(tokens) as f64 / 1e6
    );
    println!();
    println!(
        "{:<10} {:>7} {:>9} {:>13} {:>11} {:>13} {:>11}  rel. error vs reference",
        "backend", "tokens", "experts", "weights read", "time", "memory floor", "time/floor",
    );
    println!(
        "{:<10} {:>7} {:>9} {:>10.1} MB {:>11} {:>13} {:>10.1}x  {}",
        layer.backend().name(),
        tokens,
        touched,
        bytes as f64 / 1e6,
        fmt_time(median),
        fmt_time(floor),
        median.as_secs_f64() / floor.as_secs_f64(),
        match err {
            Some(e) => format!("{e:.2e} ({n} tokens; tolerance 1e-2)"),
            None => "not checked".into(),
        }
    );
    if let Some(e) = err {
        anyhow::ensure!(
            e <= 1e-2,
            "relative error {e:e} against the reference backend exceeds 1e-2"
        );
    }
    Ok(())
}
