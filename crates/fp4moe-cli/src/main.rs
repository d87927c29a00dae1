//! `fp4moe`: run NVFP4 MoE layers from the command line.

mod bench;
mod checkpoint_cmds;
mod demo;
mod host;
mod plot;
mod progress;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use fp4moe::moe::relative_l2;
use fp4moe::{layer_file, quantize_file, Backend, BackendChoice, MoeLayer};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

#[derive(Parser)]
#[command(
    name = "fp4moe",
    version,
    about = "NVFP4 Mixture-of-Experts layers: exact reference, fast CPU path"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum BackendArg {
    Auto,
    Reference,
    Cpu,
    Cuda,
}

impl BackendArg {
    pub(crate) fn choice(self) -> BackendChoice {
        match self {
            BackendArg::Auto => BackendChoice::Auto,
            BackendArg::Reference => BackendChoice::Use(Backend::Reference),
            BackendArg::Cpu => BackendChoice::Use(Backend::Cpu),
            BackendArg::Cuda => BackendChoice::Use(Backend::Cuda),
        }
    }
}

#[derive(Clone, Copy, Debug, ValueEnum)]
pub(crate) enum PresetArg {
    #[value(name = "nemotron3-nano")]
    Nemotron3Nano,
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
}

impl From<PresetArg> for fp4moe::synthetic::Preset {
    fn from(p: PresetArg) -> Self {
        match p {
            PresetArg::Nemotron3Nano => Self::Nemotron3Nano,
            PresetArg::Qwen3_30bA3b => Self::Qwen3_30bA3b,
        }
    }
}

#[derive(Subcommand)]
enum Command {
    /// Build a synthetic NVFP4 layer of a real model's shape, run a batch through the best
    /// backend, check tokens against the reference backend and print timings and floors.
    Demo {
        #[arg(long, value_enum, default_value = "nemotron3-nano")]
        preset: PresetArg,
        /// Tokens in the batch.
        #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
        tokens: u64,
        #[arg(long, value_enum, default_value = "auto")]
        backend: BackendArg,
        /// Seed of the synthetic weights and tokens.
        #[arg(long, default_value_t = 0)]
        seed: u64,
        /// Tokens checked against the reference backend.
        #[arg(long, default_value_t = 4)]
        check_tokens: usize,
    },
    /// Run one layer stored in the golden `moe_*` layout (the repro format for bug reports).
    RunLayer {
        #[arg(long)]
        file: PathBuf,
        #[arg(long, value_enum, default_value = "auto")]
        backend: BackendArg,
        /// Writes `output` f32 [T, H], `topk_ids` i32 [T, k], `topk_weights` f32 [T, k].
        #[arg(long)]
        output: Option<PathBuf>,
        /// Replace an existing output file.
        #[arg(long)]
        force: bool,
        /// Exit with an error when routing or output disagree with the file's expectations.
        #[arg(long)]
        check: bool,
    },
    /// Run one MoE layer of a ModelOpt NVFP4 checkpoint on `x` [T, H] from a safetensors file;
    /// writes `output` f32 [T, H], `topk_ids`, `topk_weights`.
    Run {
        #[arg(long)]
        checkpoint: PathBuf,
        #[arg(long)]
        layer: usize,
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        output: PathBuf,
        #[arg(long, value_enum, default_value = "auto")]
        backend: BackendArg,
        /// Override the checkpoint's mode (w4a16 runs a W4A4 checkpoint weight-only).
        #[arg(long, value_enum)]
        mode: Option<checkpoint_cmds::RunMode>,
        #[arg(long)]
        force: bool,
    },
    /// Quantize a bf16 checkpoint's MoE experts to NVFP4 (ModelOpt recipe); other tensors are
    /// copied. With --calib (a safetensors file with `x` [T, H]) it writes NVFP4 (W4A4) with
    /// calibrated input scales, else W4A16_NVFP4.
    Quantize {
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        output: PathBuf,
        #[arg(long)]
        calib: Option<PathBuf>,
        /// Leave shared experts in bf16.
        #[arg(long)]
        no_shared: bool,
        #[arg(long)]
        force: bool,
    },
    /// Describe a checkpoint: family, MoE layers, routing, quantization, block-scale statistics.
    Inspect {
        dir: PathBuf,
        /// Machine-readable output.
        #[arg(long)]
        json: bool,
    },
    /// Time the layer per batch size against the DESIGN 5 memory and compute floors.
    Bench(bench::Args),
    /// Draw benchmark JSON files (one preset) as an SVG chart of time/floor against tokens.
    Plot {
        /// The SVG to write.
        #[arg(long)]
        out: PathBuf,
        /// Chart title (default: the preset).
        #[arg(long)]
        title: Option<String>,
        /// `fp4moe bench --json` outputs and PyTorch peer outputs; the first fp4moe one sets the floor.
        #[arg(required = true)]
        json: Vec<PathBuf>,
    },
    /// Compile every CUDA kernel with NVRTC (no GPU needed) and print registers, shared memory
    /// and spills per kernel; fails on any spill or serialized wgmma pipeline.
    CompileKernels {
        /// Architectures, e.g. sm_90a,sm_80.
        #[arg(long, value_delimiter = ',', default_value = "sm_90a,sm_80")]
        arch: Vec<String>,
    },
    /// Quantize every 2-D BF16/F32 tensor of a safetensors file to NVFP4 (ModelOpt recipe).
    QuantizeTensors {
        #[arg(long)]
        input: PathBuf,
        #[arg(long)]
        output: PathBuf,
        /// Replace an existing output file.
        #[arg(long)]
        force: bool,
    },
}

pub(crate) fn check_output(input: Option<&Path>, output: &Path, force: bool) -> Result<()> {
    if let Some(i) = input {
        if i == output
            || (output.exists()
                && std::fs::canonicalize(i).ok() == std::fs::canonicalize(output).ok())
        {
            bail!(
                "--output {} is the input file; inputs are never modified",
                output.display()
            );
        }
    }
    if output.exists() && !force {
        bail!(
            "--output {} exists; pass --force to replace it",
            output.display()
        );
    }
    Ok(())
}

fn run_layer(
    file: &Path,
    backend: BackendArg,
    output: Option<&Path>,
    force: bool,
    check: bool,
) -> Result<()> {
    if let Some(o) = output {
        check_output(Some(file), o, force)?;
    }
    let lf = layer_file::read(file)?;
    let layer = MoeLayer::new(lf.spec, lf.weights.clone(), backend.choice())
        .with_context(|| format!("{}: cannot set up the layer", file.display()))?;
    let t0 = std::time::Instant::now();
    let (out, topk) = layer
        .run(&lf.x, lf.router_logits.as_deref())
        .with_context(|| format!("{}: running the layer", file.display()))?;
    let elapsed = t0.elapsed();
    let s = &lf.spec;
    println!(
        "{}: {} ({}), {}, H {} I {} E {} top-{}, {} tokens",
        lf.name,
        s.activation,
        if s.activation.is_gated() {
            "gated"
        } else {
            "non-gated"
        },
        s.quant,
        s.shape.hidden,
        s.shape.intermediate,
        s.shape.experts,
        s.routing.top_k,
        lf.tokens
    );
    println!(
        "backend {}: {:.3} ms",
        layer.backend(),
        elapsed.as_secs_f64() * 1e3
    );
    let mut problems = Vec::new();
    if let Some(ids) = &lf.expected.topk_ids {
        let same = ids == &topk.ids;
        println!(
            "routing ids: {}",
            if same {
                "match expected_topk_ids"
            } else {
                "DIFFER from expected_topk_ids"
            }
        );
        if !same {
            problems.push("routing ids differ from expected_topk_ids".to_string());
        }
    }
    if let Some(w) = &lf.expected.topk_weights {
        let e = relative_l2(&topk.weights, w);
        println!("relative L2 error of routing weights vs expected_topk_weights: {e:.3e}");
        if e > 1e-6 {
            problems.push(format!(
                "routing weights differ from expected_topk_weights by {e:.3e} (tolerance 1e-6)"
            ));
        }
    }
    if let Some(want) = &lf.expected.output {
        let e = relative_l2(&out, want);
        let tol = tolerance(layer.backend(), s.quant);
        println!(
            "relative L2 error vs expected_output: {e:.3e} (tolerance {tol:e} for {})",
            layer.backend()
        );
        if e > tol {
            problems.push(format!("output error {e:.3e} exceeds {tol:e}"));
        }
    }
    if out.iter().any(|v| !v.is_finite()) {
        bail!("{}: the output holds non-finite values", file.display());
    }
    if let Some(o) = output {
        layer_file::write_outputs(o, &out, &topk, s.shape.hidden)?;
        println!("wrote {}", o.display());
    }
    if check && !problems.is_empty() {
        bail!("{}: {}", file.display(), problems.join("; "));
    }
    Ok(())
}

/// DESIGN 2 tolerances against the float64 oracle behind the golden data.
fn tolerance(backend: Backend, quant: fp4moe::spec::QuantMode) -> f64 {
    match (backend, quant) {
        (Backend::Reference, fp4moe::spec::QuantMode::W4A16) => 1e-5,
        (Backend::Reference, _) => 5e-3,
        _ => 1e-2,
    }
}

fn quantize_tensors(input: &Path, output: &Path, force: bool) -> Result<()> {
    check_output(Some(input), output, force)?;
    let summary = progress::step("quantizing tensors", || {
        quantize_file::quantize_tensors(input, output)
    })?;
    for q in &summary {
        println!(
            "{:<48} [{}, {}]  scale_2 {:.6e}",
            q.name, q.rows, q.cols, q.scale_2
        );
    }
    println!(
        "wrote {} ({} tensors quantized)",
        output.display(),
        summary.len()
    );
    Ok(())
}

fn compile_kernels(archs: &[String]) -> Result<()> {
    let (major, minor) = fp4moe::cuda::nvrtc_version().map_err(anyhow::Error::msg)?;
    println!(
        "NVRTC {major}.{minor}, headers from {}",
        fp4moe::cuda::include_dir()
            .map(|d| d.display().to_string())
            .unwrap_or_else(|| "?".into())
    );
    let (mut spills, mut serialized) = (Vec::new(), Vec::new());
    for arch in archs {
        let compiled = progress::step(&format!("compiling kernels for {arch}"), || {
            fp4moe::cuda::compile_all(arch)
        })?;
        println!("\n{arch}:");
        println!(
            "{:<28} {:>5} {:>10} {:>7} {:>12}",
            "kernel", "regs", "smem (B)", "stack", "spill st/ld"
        );
        for c in &compiled {
            for k in fp4moe::cuda::serialized_wgmma(&c.log) {
                serialized.push(format!("{arch} {k}"));
            }
            for k in fp4moe::cuda::parse_ptxas(&c.log) {
                println!(
                    "{:<28} {:>5} {:>10} {:>7} {:>6}/{:<5}",
                    k.kernel,
                    k.registers,
                    k.shared_bytes,
                    k.stack_bytes,
                    k.spill_stores,
                    k.spill_loads
                );
                if k.spill_stores > 0 || k.spill_loads > 0 {
                    spills.push(format!("{arch} {}", k.kernel));
                }
            }
        }
    }
    if !spills.is_empty() {
        bail!("register spills in: {}", spills.join(", "));
    }
    if !serialized.is_empty() {
        bail!(
            "ptxas serialized the wgmma pipeline (C7520) in: {}",
            serialized.join(", ")
        );
    }
    Ok(())
}

/// `fp4moe plot`: the chart of `json` (see `plot.rs`) written to `out`.
fn write_plot(out: &Path, title: Option<&str>, json: &[PathBuf]) -> Result<()> {
    let docs = plot::read_docs(json)?;
    let (preset, lines) = plot::series(&docs)?;
    let svg = plot::svg(title.unwrap_or(&preset), &lines);
    fp4moe::tensor_io::write_atomic(out, svg.as_bytes())?;
    eprintln!("wrote {} ({} lines)", out.display(), lines.len());
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo {
            preset,
            tokens,
            backend,
            seed,
            check_tokens,
        } => demo::run(preset, tokens as usize, backend, seed, check_tokens),
        Command::RunLayer {
            file,
            backend,
            output,
            force,
            check,
        } => run_layer(&file, backend, output.as_deref(), force, check),
        Command::QuantizeTensors {
            input,
            output,
            force,
        } => quantize_tensors(&input, &output, force),
        Command::CompileKernels { arch } => compile_kernels(&arch),
        Command::Run {
            checkpoint,
            layer,
            input,
            output,
            backend,
            mode,
            force,
        } => checkpoint_cmds::run(&checkpoint, layer, &input, &output, backend, mode, force),
        Command::Inspect { dir, json } => checkpoint_cmds::inspect(&dir, json),
        Command::Quantize {
            input,
            output,
            calib,
            no_shared,
            force,
        } => checkpoint_cmds::quantize(&input, &output, calib.as_deref(), no_shared, force),
        Command::Bench(args) => bench::run(args),
        Command::Plot { out, title, json } => write_plot(&out, title.as_deref(), &json),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}
