//! Device timing for `fp4moe bench` (DESIGN 5): CUDA-graph replays of the whole layer (routing
//! included) timed with CUDA events, after warm-up, rotating among several input sets and
//! several uploaded copies of the weights so that neither stays resident in L2.
//!
//! The warm-up is measured in GPU time ([`TimingPlan::warmup_ms`]) because the clock is not
//! constant under load: on the H200 a sustained prefill reaches the 700 W software power cap
//! within ~50–100 ms and the SM clock falls from 1980 MHz to ~1750–1800 (run 119, KERNEL_NOTES
//! session 27), so a short timing window after a short warm-up measures the boost clock, or a
//! mix of both clocks (the "bimodal" medians of sessions 16–26). Decode loads reach the cap
//! too, ~0.8 s in from idle, and the controller dips the clock for ~0.2–0.3 s about once a
//! second before it settles (run 197), so the first sizes also wait until
//! [`TimingPlan::settle_ms`] of GPU time were replayed in all, and every size is timed over
//! [`TimingPlan::min_time_ms`]: a ~30 ms window had timed a size at the boost clock or in a
//! dip by its place in the token list (4–8 %, session 44).

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
}

/// How [`BenchLayers::time`] replays a layer.
#[derive(Clone, Copy, Debug)]
pub struct TimingPlan {
    /// Timed replays, at least (whole rounds of every graph; more where `min_time_ms` asks).
    pub iterations: usize,
    /// Untimed replays before the timed ones: three rounds of every graph, then more until at
    /// least this many ms of GPU time have passed (0: the three rounds only), so the timed
    /// replays run at the clock a sustained load settles to.
    pub warmup_ms: f64,
    /// The first sizes' warm-up lasts until the [`BenchLayers`] have replayed this many ms of
    /// GPU time in all: from idle, the H200's power draw (a ~1 s running mean) reaches the
    /// 700 W cap ~0.8 s into a sustained decode load, where the controller drops the SM clock
    /// to ~1600 MHz for ~0.2 s before it settles (run 197).
    pub settle_ms: f64,
    /// The timed replays last at least this many ms of GPU time: under the cap the clock dips
    /// again about once a second for ~0.2–0.3 s, and a median over ~30 ms of replays that fell
    /// into a dip was 4–10 % high (runs 195–197: the third and sixth sizes of a token list).
    pub min_time_ms: f64,
}

/// Several uploaded copies of one layer's weights, built once and timed at any number of batch
/// sizes: packing and uploading the weights takes seconds per copy, the timing of one size less
/// than that.
pub struct BenchLayers {
    layers: Vec<CudaLayer>,
    /// GPU ms replayed so far (warm-up and timed), for [`TimingPlan::settle_ms`].
    busy_ms: f64,
}

impl BenchLayers {
    /// Packs and uploads `copies` (at least one) copies of `weights`, rotated with the inputs
    /// when timed.
    pub fn new(spec: &MoeSpec, weights: &MoeWeights, copies: usize) -> Result<Self> {
        let layers = (0..copies.max(1))
            .map(|_| CudaLayer::new(spec, weights))
            .collect::<Result<_>>()?;
        Ok(Self {
            layers,
            busy_ms: 0.0,
        })
    }

    /// One workspace per input set (each `[tokens, H]`), its input uploaded and one eager
    /// forward run (module load, first touch) before any capture.
    fn workspaces(&self, inputs: &[Vec<f32>]) -> Result<Vec<CudaWorkspace>> {
        let layers = &self.layers;
        let st = layers[0].stream().clone();
        let hidden = layers[0].spec.shape.hidden;
        let tokens = inputs.first().map_or(0, |x| x.len() / hidden);
        let mut wss: Vec<CudaWorkspace> = Vec::new();
        for x in inputs {
            let mut ws = layers[0].workspace(tokens)?;
            st.memcpy_htod(x, &mut ws.x)
                .map_err(driver_err("input upload"))?;
            wss.push(ws);
        }
        for (i, ws) in wss.iter_mut().enumerate() {
            layers[i % layers.len()].forward_device(ws, None)?;
        }
        st.synchronize().map_err(driver_err("synchronize"))?;
        Ok(wss)
    }

    /// Times `tokens`-token forwards of the whole layer: `inputs` token sets (each
    /// `[tokens, H]`), one CUDA graph per (weight copy, input), replayed as `plan` says.
    pub fn time(&mut self, inputs: &[Vec<f32>], plan: TimingPlan) -> Result<Timing> {
        let mut wss = self.workspaces(inputs)?;
        let layers = &self.layers;
        let times = replay_times(layers, &mut wss, &plan, &mut self.busy_ms)?;
        if let Some(report) = layers[0].one_token_trace_report(&wss[0])? {
            eprintln!("{report}");
        }
        Ok(Timing {
            median_us: times[times.len() / 2],
            min_us: times[0],
            max_us: times[times.len() - 1],
            iterations: times.len(),
        })
    }

    /// What each of [`super::STAGES`] adds to a replay of `tokens`-token forwards: the medians
    /// of graphs cut after 1, 2 and 3 stages (as [`BenchLayers::time`] replays them), then
    /// `whole_us`, the whole layer's median from [`BenchLayers::time`], as successive
    /// differences.
    ///
    /// Time every batch size's whole layer before any cut graphs: once a process has replayed
    /// cut graphs, later whole-layer graphs ran up to ~20 µs slower on the H200 (64 tokens,
    /// KERNEL_NOTES run 168; the cut graphs did not), which made the last stage, the combine,
    /// look that much longer.
    pub fn stages(
        &mut self,
        inputs: &[Vec<f32>],
        plan: TimingPlan,
        whole_us: f64,
    ) -> Result<Vec<f64>> {
        let mut wss = self.workspaces(inputs)?;
        let prefix = stage_prefixes(&mut self.layers, &mut wss, &plan, &mut self.busy_ms);
        // Whole forwards again, whether or not the cut graphs ran.
        for layer in self.layers.iter_mut() {
            layer.set_stage_limit(None);
        }
        let mut prefix = prefix?;
        prefix.push(whole_us);
        Ok(prefix
            .iter()
            .scan(0.0, |before, &p| {
                let d = p - *before;
                *before = p;
                Some(d)
            })
            .collect())
    }

    /// Medians of the bare-read yardstick at `tokens`-token batches, one per
    /// [`super::BareRead::ALL`], as [`BenchLayers::time`] replays the layer. Alone, each graph
    /// reads the experts its workspace's eager forward grouped.
    pub fn bare_reads(&mut self, inputs: &[Vec<f32>], plan: TimingPlan) -> Result<[f64; 3]> {
        let mut wss = self.workspaces(inputs)?;
        let mut medians = [0.0; 3];
        let mut result = Ok(());
        for (m, mode) in super::BareRead::ALL.into_iter().enumerate() {
            result = self
                .layers
                .iter_mut()
                .try_for_each(|l| l.set_bare_read(Some(mode)))
                .and_then(|()| replay_times(&self.layers, &mut wss, &plan, &mut self.busy_ms))
                .map(|t| medians[m] = t[t.len() / 2]);
            if result.is_err() {
                break;
            }
        }
        // The layer again, whether or not the yardstick ran.
        for layer in self.layers.iter_mut() {
            layer.set_bare_read(None)?;
        }
        result.map(|()| medians)
    }
}

/// Median µs of the graphs cut after 1, 2, … of [`super::STAGES`] (all but the last stage).
fn stage_prefixes(
    layers: &mut [CudaLayer],
    wss: &mut [CudaWorkspace],
    plan: &TimingPlan,
    busy_ms: &mut f64,
) -> Result<Vec<f64>> {
    let mut prefix = Vec::new();
    for limit in 1..super::STAGES.len() {
        for layer in layers.iter_mut() {
            layer.set_stage_limit(Some(limit));
        }
        let t = replay_times(layers, wss, plan, busy_ms)?;
        prefix.push(t[t.len() / 2]);
    }
    Ok(prefix)
}

/// Sorted µs of the timed replays of one CUDA graph per (input workspace, layer), cycled after
/// the warm-up (three rounds, then whole rounds until `plan.warmup_ms` of GPU time have passed,
/// and until `busy_ms` reaches `plan.settle_ms`), each timed between events: whole rounds, at
/// least `plan.iterations` replays and `plan.min_time_ms` of GPU time (by the warm-up's mean
/// replay). Adds the GPU time it replayed to `busy_ms`.
fn replay_times(
    layers: &[CudaLayer],
    wss: &mut [CudaWorkspace],
    plan: &TimingPlan,
    busy_ms: &mut f64,
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
    let warm_start = ev()?;
    warm_start.record(&st).map_err(driver_err("events"))?;
    for g in graphs.iter().cycle().take(graphs.len() * 3) {
        g.launch().map_err(driver_err("graph launch"))?;
    }
    let mut warm_replays = graphs.len() * 3;
    let warm_end = ev()?;
    let warm_ms = plan.warmup_ms.max(plan.settle_ms - *busy_ms);
    let warmed_ms = loop {
        warm_end.record(&st).map_err(driver_err("events"))?;
        warm_end.synchronize().map_err(driver_err("events"))?;
        let ms = f64::from(
            warm_start
                .elapsed_ms(&warm_end)
                .map_err(driver_err("events"))?,
        );
        if ms >= warm_ms {
            break ms;
        }
        for g in &graphs {
            g.launch().map_err(driver_err("graph launch"))?;
        }
        warm_replays += graphs.len();
    };
    // Whole rounds: every (input, weight copy) graph as often as the others.
    let per_replay_ms = warmed_ms / warm_replays as f64;
    let wanted = if plan.min_time_ms > 0.0 && per_replay_ms > 0.0 {
        (plan.min_time_ms / per_replay_ms).ceil().min(1e6) as usize
    } else {
        0
    };
    let iterations = plan.iterations.max(wanted).max(1).div_ceil(graphs.len()) * graphs.len();
    let events: Vec<_> = (0..=iterations).map(|_| ev()).collect::<Result<_>>()?;
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
    // FP4MOE_BENCH_PER_GRAPH (diagnostic, unset by default): each graph's median on stderr, so a
    // bimodal median can be traced to a weight copy or an input workspace (KERNEL_NOTES, session
    // 27); `raw`: also every replay's time in launch order (drift over the run).
    if let Some(per_graph_mode) = std::env::var_os("FP4MOE_BENCH_PER_GRAPH") {
        let per_graph: Vec<String> = (0..graphs.len())
            .map(|g| {
                let mut t: Vec<f64> = times
                    .iter()
                    .skip(g)
                    .step_by(graphs.len())
                    .copied()
                    .collect();
                t.sort_by(f64::total_cmp);
                let (input, copy) = (g / layers.len(), g % layers.len());
                format!(
                    "in{input}/w{copy} {:.1}",
                    t.get(t.len() / 2).copied().unwrap_or(f64::NAN)
                )
            })
            .collect();
        eprintln!("per graph (median µs): {}", per_graph.join("  "));
        if per_graph_mode == "raw" {
            let seq: Vec<String> = times.iter().map(|t| format!("{t:.0}")).collect();
            eprintln!("replays in order (µs): {}", seq.join(" "));
        }
    }
    *busy_ms += warmed_ms + times.iter().sum::<f64>() / 1e3;
    times.sort_by(f64::total_cmp);
    Ok(times)
}
