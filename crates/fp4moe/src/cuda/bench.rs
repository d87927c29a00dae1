//! Device timing for `fp4moe bench` (DESIGN 5): CUDA-graph replays of the whole layer (routing
//! included) timed with CUDA events, after warm-up, rotating among several input sets and
//! several uploaded copies of the weights so that neither stays resident in L2.

use super::{driver_err, CudaLayer, CudaWorkspace};
use crate::error::{Error, Result};
use crate::spec::MoeSpec;
use crate::weights::MoeWeights;
use cudarc::driver::sys as dsys;

/// Read+write bandwidth of a large device-to-device copy, bytes/s (best of several).
pub fn copy_bandwidth() -> Result<f64> {
    let dev = super::device()?;
    let st = &dev.stream;
    let n: usize = 1 << 30;
    let src = st
        .alloc_zeros::<u8>(n)
        .map_err(driver_err("bandwidth probe"))?;
    let mut dst = st
        .alloc_zeros::<u8>(n)
        .map_err(driver_err("bandwidth probe"))?;
    let e0 = dev
        .ctx
        .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver_err("events"))?;
    let e1 = dev
        .ctx
        .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
        .map_err(driver_err("events"))?;
    let mut best = f32::MAX;
    for _ in 0..6 {
        e0.record(st).map_err(driver_err("events"))?;
        st.memcpy_dtod(&src, &mut dst)
            .map_err(driver_err("bandwidth probe"))?;
        e1.record(st).map_err(driver_err("events"))?;
        e1.synchronize().map_err(driver_err("events"))?;
        best = best.min(e0.elapsed_ms(&e1).map_err(driver_err("events"))?);
    }
    Ok(2.0 * n as f64 / (best as f64 * 1e-3))
}

/// Median and spread of one batch size.
#[derive(Clone, Debug)]
pub struct Timing {
    pub median_us: f64,
    pub min_us: f64,
    pub max_us: f64,
    pub iterations: usize,
    /// Median µs each of [`super::STAGES`] adds to a replay, when asked for.
    pub stages_us: Option<Vec<f64>>,
}

/// Times `tokens`-token forwards: `inputs` token sets (each `[tokens, H]`), `copies` uploaded
/// weight copies, one CUDA graph per (copy, input), `iterations` timed replays after warm-up;
/// `stages`: also time graphs of the layer cut after 1, 2 and 3 of [`super::STAGES`]; a stage's
/// time is the difference of successive medians (what the stage adds to a replay).
pub fn time_layer(
    spec: &MoeSpec,
    weights: &MoeWeights,
    inputs: &[Vec<f32>],
    copies: usize,
    iterations: usize,
    stages: bool,
) -> Result<Timing> {
    // FP4MOE_BENCH_PAD_MB (a diagnostic knob, unset by default): a device buffer of that many MiB
    // allocated before the weight copies and workspaces, which moves where they land.
    // Nemotron's 4096-token median falls in one of two clusters per process (KERNEL_NOTES,
    // session 26): a cluster that follows the pad would point at placement.
    let pad_bytes = match std::env::var("FP4MOE_BENCH_PAD_MB") {
        Ok(v) => v
            .trim()
            .parse::<usize>()
            .ok()
            .and_then(|mib| mib.checked_mul(1 << 20))
            .ok_or_else(|| {
                Error::arg(
                    "FP4MOE_BENCH_PAD_MB",
                    format!("{v:?} is not a whole number of MiB"),
                )
            })?,
        Err(_) => 0,
    };
    let _pad = if pad_bytes > 0 {
        let dev = super::device()?;
        Some(
            dev.stream
                .alloc_zeros::<u8>(pad_bytes)
                .map_err(driver_err("FP4MOE_BENCH_PAD_MB buffer"))?,
        )
    } else {
        None
    };
    let mut layers: Vec<CudaLayer> = (0..copies.max(1))
        .map(|_| CudaLayer::new(spec, weights))
        .collect::<Result<_>>()?;
    let st = layers[0].stream().clone();
    let tokens = inputs.first().map_or(0, |x| x.len() / spec.shape.hidden);
    let mut wss: Vec<CudaWorkspace> = Vec::new();
    for x in inputs {
        let mut ws = layers[0].workspace(tokens)?;
        st.memcpy_htod(x, &mut ws.x)
            .map_err(driver_err("input upload"))?;
        wss.push(ws);
    }
    // Warm-up eagerly (module load, first-touch) before any capture.
    for (i, ws) in wss.iter_mut().enumerate() {
        layers[i % layers.len()].forward_device(ws, None)?;
    }
    st.synchronize().map_err(driver_err("synchronize"))?;
    let times = replay_times(&layers, &mut wss, iterations)?;
    if let Some(report) = layers[0].one_token_trace_report(&wss[0])? {
        eprintln!("{report}");
    }
    let stages_us = if stages {
        let mut prefix = Vec::new();
        for limit in 1..super::STAGES.len() {
            for layer in &mut layers {
                layer.set_stage_limit(Some(limit));
            }
            let t = replay_times(&layers, &mut wss, iterations)?;
            prefix.push(t[t.len() / 2]);
        }
        prefix.push(times[times.len() / 2]);
        Some(
            prefix
                .iter()
                .scan(0.0, |before, &p| {
                    let d = p - *before;
                    *before = p;
                    Some(d)
                })
                .collect(),
        )
    } else {
        None
    };
    Ok(Timing {
        median_us: times[times.len() / 2],
        min_us: times[0],
        max_us: times[times.len() - 1],
        iterations,
        stages_us,
    })
}

/// Sorted µs of `iterations` replays of one CUDA graph per (input workspace, layer), cycled
/// after three warm-up rounds, each timed between events.
fn replay_times(
    layers: &[CudaLayer],
    wss: &mut [CudaWorkspace],
    iterations: usize,
) -> Result<Vec<f64>> {
    let st = layers[0].stream().clone();
    let dev = layers[0].device();
    let mut graphs = Vec::new();
    for (i, ws) in wss.iter_mut().enumerate() {
        for layer in layers {
            st.begin_capture(dsys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(driver_err("graph capture"))?;
            let r = layer.forward_device(ws, None);
            let g = st
                .end_capture(dsys::CUgraphInstantiate_flags(0))
                .map_err(driver_err("graph capture"))?;
            r?;
            graphs.push(g.ok_or_else(|| Error::Cuda {
                stage: "graph capture",
                message: format!("nothing captured for input {i}"),
            })?);
        }
    }
    let ev = || {
        dev.ctx
            .new_event(Some(dsys::CUevent_flags::CU_EVENT_DEFAULT))
            .map_err(driver_err("events"))
    };
    let events: Vec<_> = (0..=iterations).map(|_| ev()).collect::<Result<_>>()?;
    for g in graphs.iter().cycle().take(graphs.len() * 3) {
        g.launch().map_err(driver_err("graph launch"))?;
    }
    events[0].record(&st).map_err(driver_err("events"))?;
    for (it, g) in graphs.iter().cycle().take(iterations).enumerate() {
        g.launch().map_err(driver_err("graph launch"))?;
        events[it + 1].record(&st).map_err(driver_err("events"))?;
    }
    st.synchronize().map_err(driver_err("synchronize"))?;
    let mut times: Vec<f64> = events
        .windows(2)
        .map(|w| {
            w[0].elapsed_ms(&w[1])
                .map(|ms| ms as f64 * 1e3)
                .map_err(driver_err("events"))
        })
        .collect::<Result<_>>()?;
    times.sort_by(f64::total_cmp);
    Ok(times)
}
