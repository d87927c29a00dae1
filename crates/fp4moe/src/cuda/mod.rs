//! The CUDA backend: NVRTC-compiled kernels (`crates/fp4moe/kernels/*.cu`), weights prepared
//! once into the decode kernels' fragment layout ([`pack`]), and a device pipeline with no host
//! synchronization, so a caller can capture [`CudaLayer::forward_device`] in a CUDA graph:
//!
//! ```text
//! router_logits? → route_topk → sort_pairs → prepare_input(_sorted) → gemm1 (+act, W4A4 QDQ) → gemm2
//!               (shared expert: gemm1 → gemm2) → combine → y [T, H]
//! ```
//! Small batches ([`RoutePath`]) run the first four stages as one launch, `route_small`, on the
//! same device code (bitwise the same results); one token of a non-gated layer runs the whole
//! layer as one launch (`one_token.cu`, bitwise the same results again). The shared expert's grouping (every token once,
//! weight 1) is written once per workspace. No float atomics anywhere: results are bitwise
//! reproducible from run to run. Between the GEMMs the intermediate is bf16 (DESIGN 2's "bf16
//! intermediates"), and so is each pair's weighted GEMM2 output, which the combine sums in f32
//! in slot order (as vLLM's, SGLang's and TensorRT-LLM's fused MoE store them).
//!
//! Every `unsafe` block of the crate lives under this module, each with a `// SAFETY:` line.
//! A machine without a driver never reaches cudarc's loaders: [`device`] checks
//! `is_culib_present()` first and reports [`Error::CudaUnavailable`].

pub mod bench;
mod compile;
mod gemm_plan;
mod one_token;
pub mod pack;
mod route_plan;

pub use compile::{
    compile, include_dir, nvrtc_version, parse_ptxas, serialized_wgmma, CompileError, Compiled,
    KernelUsage, SOURCES,
};
pub use gemm_plan::*;
pub use route_plan::*;

use crate::backend::{Experts, Workspace};
use crate::error::{Error, Result};
use crate::routing::TopK;
use crate::spec::{MoeSpec, Scoring};
use crate::weights::{DenseWeight, ExpertStack, MoeWeights};
use cudarc::driver::{
    sys as dsys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DeviceRepr, LaunchConfig,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

/// The device the backend runs on (ordinal 0) with its compiled kernels.
pub struct Device {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub arch: String,
    /// Largest dynamic shared memory a block may opt into.
    pub max_shared_bytes: usize,
    /// Streaming multiprocessors.
    pub sms: usize,
    /// Whether expert GEMMs and the combine launch as programmatic dependents (sm_90+ and a
    /// CUDA 12.3+ driver; the knob `FP4MOE_PDL=0` turns it off).
    pub pdl: bool,
    kernels: OnceLock<std::result::Result<Kernels, String>>,
}

struct Kernels {
    functions: HashMap<String, CudaFunction>,
    _modules: Vec<Arc<CudaModule>>,
}

fn driver_err(stage: &'static str) -> impl Fn(cudarc::driver::DriverError) -> Error {
    move |e| Error::Cuda {
        stage,
        message: e.to_string(),
    }
}

/// The NVRTC architecture for a compute capability.
pub fn arch_for(cc: (i32, i32)) -> String {
    match cc {
        (9, 0) => "sm_90a".to_string(),
        (major, minor) => format!("sm_{major}{minor}"),
    }
}

fn open_device() -> std::result::Result<Device, String> {
    // SAFETY: only probes whether libcuda can be opened; no CUDA call is made before this.
    if !unsafe { dsys::is_culib_present() } {
        return Err("no CUDA driver (libcuda) on this machine".into());
    }
    let n =
        CudaContext::device_count().map_err(|e| format!("cuInit/cuDeviceGetCount failed: {e}"))?;
    if n < 1 {
        return Err("the CUDA driver reports no device".into());
    }
    let ctx =
        CudaContext::new(0).map_err(|e| format!("cannot create a context on device 0: {e}"))?;
    let cc = ctx.compute_capability().map_err(|e| e.to_string())?;
    if cc.0 < 8 {
        return Err(format!(
            "device 0 has compute capability {}.{}; fp4moe needs 8.0 (Ampere) or newer",
            cc.0, cc.1
        ));
    }
    compile::nvrtc_version()?;
    if compile::include_dir().is_none() {
        return Err(
            "CUDA headers (cuda_bf16.h) not found: set CUDA_HOME or FP4MOE_CUDA_INCLUDE".into(),
        );
    }
    // SAFETY: every buffer this backend creates is used on its one stream only, so cudarc's
    // cross-stream event tracking is unnecessary; it would also add event records to captures.
    unsafe { ctx.disable_event_tracking() };
    let stream = ctx.new_stream().map_err(|e| e.to_string())?;
    let max_shared_bytes = ctx
        .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        .map_err(|e| e.to_string())? as usize;
    let sms = ctx
        .attribute(dsys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| e.to_string())? as usize;
    // Programmatic launches need sm_90 and, inside graph captures, a 12.3+ driver.
    let mut driver = 0;
    // SAFETY: writes one int; the driver was initialized by the context creation above.
    let driver = match unsafe { dsys::cuDriverGetVersion(&mut driver) }.result() {
        Ok(()) => driver,
        Err(_) => 0,
    };
    let pdl =
        cc.0 >= 9 && driver >= 12030 && std::env::var("FP4MOE_PDL").map_or(true, |v| v != "0");
    Ok(Device {
        max_shared_bytes,
        sms,
        pdl,
        name: ctx.name().unwrap_or_else(|_| "unknown".into()),
        // FP4MOE_CUDA_ARCH (e.g. `sm_90` on a Hopper part: no wgmma, the mma.sync prefill
        // kernels) is a testing knob; the default is the device's own architecture.
        arch: std::env::var("FP4MOE_CUDA_ARCH")
            .ok()
            .filter(|a| a.starts_with("sm_"))
            .unwrap_or_else(|| arch_for(cc)),
        compute_capability: cc,
        ctx,
        stream,
        kernels: OnceLock::new(),
    })
}

static DEVICE: OnceLock<std::result::Result<Device, String>> = OnceLock::new();

/// The CUDA device, or why there is none.
pub fn device() -> Result<&'static Device> {
    DEVICE
        .get_or_init(open_device)
        .as_ref()
        .map_err(|reason| Error::CudaUnavailable {
            reason: reason.clone(),
        })
}

/// Compiles every kernel file for `arch` (no device needed): what CI uses to check registers,
/// shared memory and spills.
pub fn compile_all(arch: &str) -> std::result::Result<Vec<Compiled>, CompileError> {
    SOURCES
        .iter()
        .map(|(file, src)| compile::compile(file, src, arch))
        .collect()
}

impl Device {
    fn kernels(&self) -> Result<&Kernels> {
        self.kernels
            .get_or_init(|| {
                let mut functions = HashMap::new();
                let mut modules = Vec::new();
                for c in compile_all(&self.arch).map_err(|e| e.to_string())? {
                    let module = self.ctx.load_module(Ptx::from_binary(c.cubin)).map_err(|e| format!("loading {}: {e}", c.file))?;
                    // The kernel list is static (not read from the ptxas log, which a cached or
                    // quiet compile need not carry).
                    for name in compile::kernel_names(&c.file) {
                        let f = module.load_function(&name).map_err(|e| format!("{}: {name}: {e}", c.file))?;
                        let static_smem = f.shared_size_bytes().map_err(|e| format!("{name}: {e}"))? as usize;
                        // Opt in once, here, so no attribute call happens inside a graph capture.
                        f.set_attribute(
                            dsys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            self.max_shared_bytes.saturating_sub(static_smem) as i32,
                        )
                        .map_err(|e| format!("{name}: {e}"))?;
                        functions.insert(name, f);
                    }
                    modules.push(module);
                }
                Ok(Kernels {
                    functions,
                    _modules: modules,
                })
            })
            .as_ref()
            .map_err(|m| Error::Cuda {
                stage: "kernel setup",
                message: m.clone(),
            })
    }

    fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.kernels()?
            .functions
            .get(name)
            .ok_or_else(|| Error::Cuda {
                stage: "kernel setup",
                message: format!("kernel `{name}` is missing from the compiled modules"),
            })
    }
}

/// Parameters of the expert GEMM kernels (`expert_gemm.cu`, `expert_stream.cu`,
/// `prefill_gemm.cu`); the layout matches `struct GemmParams` in `gemm_common.cuh`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct GemmParams {
    wdata: u64,
    wscales: u64,
    wscale2: u64,
    act: u64,
    offsets: u64,
    sorted: u64,
    active: u64,
    num_active: u64,
    g_out: u64,
    topk_w: u64,
    o_out: u64,
    /// 0, or `[2·experts]` counters of the expert-ready handoff (`CudaWorkspace::gemm_ready`).
    ready: u64,
    rg_out: i32,
    rg_w: i32,
    kg: i32,
    k: i32,
    shards: i32,
    top_k: i32,
    activation: i32,
    out_stride: i32,
    act_alpha: f32,
    gs_out: f32,
    tile_rows: i32,
    experts: i32,
    /// GEMM2 of the expert-ready handoff: GEMM1's blocks per expert (0: `pdl_wait`), per token
    /// tile of `wait_nt` rows where GEMM1 ran prefill tiles (0: decode, one block row).
    wait_blocks: i32,
    wait_nt: i32,
}

// SAFETY: `GemmParams` is `repr(C)`, plain old data, and mirrors the kernel's parameter struct
// field for field (12 pointers, 8 ints, 2 floats, 4 ints; no implicit padding).
unsafe impl DeviceRepr for GemmParams {}

/// Device pointers of a token grouping by expert (`sort_pairs.cu`'s outputs, or the shared
/// expert's single group written by [`CudaLayer::workspace`]), as both GEMMs read it.
#[derive(Clone, Copy, Debug)]
struct Grouping {
    offsets: u64,
    sorted: u64,
    active: u64,
    num_active: u64,
    /// Experts the offsets cover (`offsets[0..=experts]`).
    experts: i32,
}

impl Grouping {
    /// `route_small` parameters writing this grouping (the rest default).
    fn route_params(self) -> RouteSmallParams {
        RouteSmallParams {
            offsets: self.offsets,
            sorted: self.sorted,
            active: self.active,
            num_active: self.num_active,
            ..Default::default()
        }
    }

    /// `params` reading this grouping.
    fn params(self, params: GemmParams) -> GemmParams {
        GemmParams {
            offsets: self.offsets,
            sorted: self.sorted,
            active: self.active,
            num_active: self.num_active,
            experts: self.experts,
            ..params
        }
    }
}

/// The routing's inputs and outputs as `route_small.cu` and `one_token.cu` list them (six
/// consecutive pointers in both kernels' parameter structs): the tokens, the router weight (0
/// unless logits are computed), the logits (computed into the workspace, or the caller's), the
/// selection bias (0 for none), and the ids and weights written.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RouteIo {
    x: u64,
    router: u64,
    logits: u64,
    bias: u64,
    ids: u64,
    weights: u64,
}

/// A type a kernel takes by value, the C type of the same size: `int`, `float`, a device
/// pointer (`u64`), or a parameter struct whose layout a test pins (sealed: nothing else can be
/// pushed, so no `usize` or `bool` lands where the kernel reads an `int`).
trait KernelArg: DeviceRepr + Copy {}
impl KernelArg for i32 {}
impl KernelArg for f32 {}
impl KernelArg for u64 {}
impl KernelArg for RouteSmallParams {}
impl KernelArg for one_token::OneTokenParams {}

/// A kernel's arguments by value for `cuLaunchKernelEx` (cudarc 0.19's launch builder takes no
/// launch attributes, and the routing kernels launch as programmatic dependents): each value at
/// an 8-byte-aligned offset of one buffer, from which the driver reads the parameter's size.
#[derive(Default)]
struct KernelArgs {
    words: Vec<u64>,
    starts: Vec<usize>,
}

impl KernelArgs {
    fn arg<T: KernelArg>(&mut self, v: &T) -> &mut Self {
        const { assert!(std::mem::align_of::<T>() <= 8) };
        let at = self.words.len();
        self.words
            .resize(at + std::mem::size_of::<T>().div_ceil(8).max(1), 0);
        // SAFETY: words[at..] is 8-byte aligned (T needs at most 8) and holds size_of::<T>()
        // bytes; KernelArg types are plain data that a kernel reads bytewise.
        unsafe { std::ptr::write(self.words.as_mut_ptr().add(at).cast::<T>(), *v) };
        self.starts.push(at);
        self
    }

    /// One pointer per argument, valid while `self` lives and takes no more arguments.
    fn pointers(&mut self) -> Vec<*mut c_void> {
        let base = self.words.as_mut_ptr();
        // SAFETY: every start is an index into `words`.
        self.starts
            .iter()
            .map(|&at| unsafe { base.add(at) }.cast())
            .collect()
    }
}

/// Parameters of `route_small.cu`; the layout matches `struct RouteSmallParams` there.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct RouteSmallParams {
    io: RouteIo,
    offsets: u64,
    sorted: u64,
    active: u64,
    num_active: u64,
    a: u64,
    xs: u64,
    ticket: u64,
    mode: i32,
    tokens: i32,
    hidden: i32,
    select: Selection,
    topk_warps: i32,
    rsf: f32,
    gs: f32,
}

/// The expert selection rule as `route_small.cu` and `one_token.cu` list it (six consecutive
/// ints in both kernels' parameter structs).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Selection {
    experts: i32,
    top_k: i32,
    /// 0 softmax, 1 sigmoid.
    scoring: i32,
    n_group: i32,
    topk_group: i32,
    renormalize: i32,
}

// SAFETY: `RouteSmallParams` is `repr(C)`, plain old data, and mirrors the kernel's parameter
// struct field for field (13 pointers, 10 ints, 2 floats; no implicit padding).
unsafe impl DeviceRepr for RouteSmallParams {}

/// Where `route_small` takes its tokens' routing from (the kernel's `mode`).
#[derive(Clone, Copy)]
enum RouteSource<'a> {
    /// Logits computed from the layer's router weight (`ROUTE_FROM_ROUTER`).
    Router,
    /// Caller's `[T, E]` logits (`ROUTE_FROM_LOGITS`).
    Logits(&'a CudaSlice<f32>),
    /// `ws.ids` / `ws.weights` already hold the routing (`ROUTE_FROM_IDS`): sort and prepare only.
    Ids,
}

/// `route_small.cu`'s modes.
const ROUTE_FROM_ROUTER: i32 = 0;
const ROUTE_FROM_LOGITS: i32 = 1;
const ROUTE_FROM_IDS: i32 = 2;

impl RouteSource<'_> {
    /// The kernel's `mode`.
    fn mode(self) -> i32 {
        match self {
            RouteSource::Router => ROUTE_FROM_ROUTER,
            RouteSource::Logits(_) => ROUTE_FROM_LOGITS,
            RouteSource::Ids => ROUTE_FROM_IDS,
        }
    }
}

/// One projection on the device in the decode kernels' layout.
struct DeviceProjection {
    nvfp4: bool,
    data: CudaSlice<u8>,
    scales: CudaSlice<u8>,
    scale_2: CudaSlice<f32>,
    rows: usize,
    k: usize,
    shards: usize,
    /// Streaming decode kernels' row-group units per block, chosen at the first streaming call
    /// ([`CudaLayer::stream_shape`]); `None` inside: no streaming shape fits.
    stream_units: OnceLock<Option<usize>>,
}

impl DeviceProjection {
    fn from_stack(stream: &Arc<CudaStream>, s: &ExpertStack) -> Result<Self> {
        let (data, scales) = pack::pack_nvfp4(s);
        Ok(Self {
            nvfp4: true,
            data: stream
                .clone_htod(&data)
                .map_err(driver_err("weight upload"))?,
            scales: stream
                .clone_htod(&scales)
                .map_err(driver_err("weight upload"))?,
            scale_2: stream
                .clone_htod(&s.scale_2)
                .map_err(driver_err("weight upload"))?,
            rows: s.rows,
            k: s.cols,
            shards: s.shards,
            stream_units: OnceLock::new(),
        })
    }

    fn from_dense(stream: &Arc<CudaStream>, w: &DenseWeight, shards: usize) -> Result<Self> {
        match w {
            DenseWeight::Nvfp4(s) => Self::from_stack(stream, s),
            DenseWeight::Bf16 { rows, cols, data } => {
                let packed = pack::pack_bf16(*rows, *cols, data);
                Ok(Self {
                    nvfp4: false,
                    data: stream
                        .clone_htod(&packed)
                        .map_err(driver_err("weight upload"))?,
                    scales: stream
                        .alloc_zeros::<u8>(1)
                        .map_err(driver_err("weight upload"))?,
                    scale_2: stream
                        .clone_htod(&vec![1.0f32; shards])
                        .map_err(driver_err("weight upload"))?,
                    rows: *rows,
                    k: *cols,
                    shards,
                    stream_units: OnceLock::new(),
                })
            }
        }
    }
}

/// Device buffers for one batch size.
pub struct CudaWorkspace {
    tokens: usize,
    pub x: CudaSlice<f32>,
    pub logits: CudaSlice<f32>,
    /// `router_logits_wide`'s partial sums over its k slices (`[splits, T, E]`), where it
    /// splits k ([`router_wide_splits`]); empty otherwise.
    router_part: CudaSlice<f32>,
    /// Routing result of the last forward: `[T, k]` expert ids and weights (rsf included).
    pub ids: CudaSlice<i32>,
    pub weights: CudaSlice<f32>,
    pub out: CudaSlice<f32>,
    a: CudaSlice<u16>,
    /// `a`'s rows in sorted pair order, the TMA-fed prefill GEMM1's operand: written by
    /// `prepare_input_sorted` on the split routing path, else copied from `a` by `gather_rows`.
    a_sorted: CudaSlice<u16>,
    /// Each routed pair's row in sorted order (`invert_pairs`): where `prepare_input_sorted`
    /// writes a token's rows of `a_sorted`.
    pair_rows: CudaSlice<i32>,
    xs: CudaSlice<u16>,
    offsets: CudaSlice<i32>,
    sorted: CudaSlice<i32>,
    /// Per-chunk expert counts, then bases, of the multi-block pair sort.
    chunk_counts: CudaSlice<i32>,
    /// `route_small`'s block ticket counter: 0 between launches (the last block resets it).
    route_ticket: CudaSlice<i32>,
    /// `one_token`'s grid-barrier counters and combine tickets (`64 + H/16`): 0 between launches.
    one_token_sync: CudaSlice<i32>,
    /// `one_token`'s phase timestamps when `FP4MOE_ONE_TOKEN_TRACE=1` (a diagnostic, left out
    /// of [`CudaLayer::workspace_bytes`]); one element otherwise.
    one_token_trace: CudaSlice<u64>,
    active: CudaSlice<i32>,
    num_active: CudaSlice<i32>,
    g: CudaSlice<u16>,
    /// Each routed pair's weighted expert output `[T·k, H]`, bf16 (GEMM2 rounds once; the
    /// combine sums in f32).
    o: CudaSlice<u16>,
    sh_offsets: CudaSlice<i32>,
    sh_sorted: CudaSlice<i32>,
    sh_active: CudaSlice<i32>,
    sh_num: CudaSlice<i32>,
    sh_ones: CudaSlice<f32>,
    sh_g: CudaSlice<u16>,
    sh_o: CudaSlice<u16>,
    /// `[2·E]`: the routed GEMMs' expert-ready counters (`expert_ready_wait` in
    /// gemm_common.cuh), zero between forwards.
    gemm_ready: CudaSlice<i32>,
}

/// The expert grouping of a forward: what the GEMMs iterate over.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ExpertGrouping {
    /// `[E + 1]`: expert e's pairs are `sorted[offsets[e]..offsets[e + 1]]`.
    pub offsets: Vec<i32>,
    /// `[T·k]`: pair indices `t·k + j`, by expert, increasing within an expert.
    pub sorted: Vec<i32>,
    /// The experts with at least one pair, in increasing id.
    pub active: Vec<i32>,
}

impl CudaWorkspace {
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Downloads the routed experts' grouping of the last forward on `stream` (synchronizing).
    pub fn grouping(&self, stream: &Arc<CudaStream>) -> Result<ExpertGrouping> {
        let get = |s: &CudaSlice<i32>| {
            stream
                .clone_dtoh(s)
                .map_err(driver_err("grouping download"))
        };
        let n = get(&self.num_active)?.first().copied().unwrap_or(0).max(0) as usize;
        let mut active = get(&self.active)?;
        active.truncate(n);
        Ok(ExpertGrouping {
            offsets: get(&self.offsets)?,
            sorted: get(&self.sorted)?,
            active,
        })
    }
}

/// A MoE layer resident on the GPU.
pub struct CudaLayer {
    spec: MoeSpec,
    dev: &'static Device,
    w13: DeviceProjection,
    w2: DeviceProjection,
    shared: Option<(DeviceProjection, DeviceProjection)>,
    router: Option<CudaSlice<f32>>,
    /// [`router_bf16_copy`] on the device, with its row stride.
    router_bf16: Option<(CudaSlice<u16>, usize)>,
    bias: Option<CudaSlice<f32>>,
    gs1: Option<f32>,
    gs2: Option<f32>,
    gemm_path: Option<GemmPath>,
    route_path: Option<RoutePath>,
    decode_kernel: Option<DecodeKernel>,
    gemm_shape: Option<GemmShape>,
    expert_handoff: Option<bool>,
    prefill_feed: Option<PrefillFeed>,
    prefill_tile: Option<PrefillTile>,
    router_kernel: Option<RouterKernel>,
    stream_units: Option<usize>,
    /// Forced on or off: the one-token layer in one launch ([`CudaLayer::set_one_token`]).
    one_token: Option<bool>,
    /// The one-token kernel's launch shape per pair of K splits (GEMM1's, GEMM2's units per
    /// virtual block), `None` where it does not fit.
    one_token_shapes: Mutex<Vec<one_token::CachedShape>>,
    /// Forwards stop after this many of [`STAGES`] (timing diagnostics).
    stage_limit: Option<usize>,
}

/// The stages [`CudaLayer::set_stage_limit`] counts: routing (with pair grouping and input
/// preparation), GEMM1 of the routed experts, the routed GEMM2 and any shared-expert GEMMs, and
/// the combine.
pub const STAGES: [&str; 4] = ["routing", "gemm1", "gemm2", "combine"];

/// Largest counts the kernels handle (shared-memory tables of `sort_pairs` and `route_topk`).
pub const MAX_EXPERTS: usize = 512;
pub const MAX_TOP_K: usize = 32;
pub const MAX_GROUPS: usize = 32;

/// The kernels' limits for `spec` ([`MAX_EXPERTS`], [`MAX_TOP_K`], [`MAX_GROUPS`]): beyond them
/// the routing kernels would write past their shared-memory scratch. `MoeLayer` checks them
/// through the backend's capabilities; [`CudaLayer::new`] checks them again for direct users.
fn check_limits(spec: &MoeSpec) -> Result<()> {
    let r = &spec.routing;
    for (what, value, max) in [
        ("experts", spec.shape.experts, MAX_EXPERTS),
        ("top_k", r.top_k, MAX_TOP_K),
        ("n_group", r.n_group, MAX_GROUPS),
    ] {
        if value > max {
            return Err(Error::Unsupported {
                backend: "cuda".into(),
                reason: format!("{what} = {value}; the CUDA kernels handle at most {max}"),
            });
        }
    }
    Ok(())
}

/// The value of a benchmark tuning variable, read once per process (into `cell`) so forwards
/// neither take the environment lock nor allocate for it.
fn tuning_knob(cell: &'static OnceLock<Option<String>>, name: &str) -> Option<&'static str> {
    cell.get_or_init(|| std::env::var(name).ok()).as_deref()
}

/// The choice a tuning variable names among `choices` (value, choice); `None` when it is unset
/// or names none of them.
fn tuning_choice<T: Copy>(
    cell: &'static OnceLock<Option<String>>,
    name: &str,
    choices: &[(&str, T)],
) -> Option<T> {
    let value = tuning_knob(cell, name)?;
    choices.iter().find(|(v, _)| *v == value).map(|&(_, c)| c)
}

/// Rows of a prefill GEMM's activation operand in sorted pair order, for its tensor map.
#[derive(Clone, Copy, Debug)]
struct SortedRows {
    ptr: u64,
    rows: usize,
    /// Row stride in bf16 elements.
    stride: usize,
}

/// 2D tensor map of `rows` (bf16, `k` valid columns): boxes of 64 k × `box_rows` rows, 128-byte
/// swizzle (what `smem_desc_sw128` reads), zero fill past K and past the last row.
fn tensor_map(rows: SortedRows, k: usize, box_rows: u32) -> Result<dsys::CUtensorMap> {
    use dsys::{
        CUtensorMapDataType_enum as Ty, CUtensorMapFloatOOBfill_enum as Oob,
        CUtensorMapInterleave_enum as Il, CUtensorMapL2promotion_enum as L2,
        CUtensorMapSwizzle_enum as Sw,
    };
    let dims: [u64; 2] = [k as u64, rows.rows.max(1) as u64];
    let strides: [u64; 1] = [(rows.stride * 2) as u64];
    let boxes: [u32; 2] = [64, box_rows];
    let steps: [u32; 2] = [1, 1];
    // SAFETY: `map` is a plain 128-byte struct the call fills; the arrays hold rank (2) and
    // rank - 1 entries as the API requires; `ptr` is a device address the map only records.
    let mut map: dsys::CUtensorMap = unsafe { std::mem::zeroed() };
    unsafe {
        dsys::cuTensorMapEncodeTiled(
            &mut map,
            Ty::CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
            2,
            rows.ptr as *mut c_void,
            dims.as_ptr(),
            strides.as_ptr(),
            boxes.as_ptr(),
            steps.as_ptr(),
            Il::CU_TENSOR_MAP_INTERLEAVE_NONE,
            Sw::CU_TENSOR_MAP_SWIZZLE_128B,
            L2::CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
            Oob::CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE,
        )
    }
    .result()
    .map_err(|e| Error::Cuda {
        stage: "tensor map",
        message: format!(
            "{} rows x {k} bf16 (stride {}): {e}",
            rows.rows, rows.stride
        ),
    })?;
    Ok(map)
}

/// `combine`'s launch for `tokens` x `hidden` (a multiple of 16, as the spec requires): a
/// block row per token, each thread 8 columns, the columns split into the fewest blocks of at
/// most 256 threads, evened out to whole warps (Nemotron's 336 eight-column units: 2 blocks of
/// 192).
fn combine_launch(tokens: usize, hidden: usize) -> LaunchConfig {
    let units = hidden / 8;
    let blocks = units.div_ceil(256).max(1);
    let threads = units.div_ceil(blocks).div_ceil(32) * 32;
    LaunchConfig {
        grid_dim: (tokens as u32, blocks as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

fn ptr<T>(s: &CudaSlice<T>, stream: &CudaStream) -> u64 {
    let (p, _sync) = s.device_ptr(stream);
    p
}

impl CudaLayer {
    /// Uploads `weights` (validated against `spec`) in the kernels' layout.
    pub fn new(spec: &MoeSpec, weights: &MoeWeights) -> Result<Self> {
        weights.validate(spec)?;
        check_limits(spec)?;
        let dev = device()?;
        dev.kernels()?;
        let st = &dev.stream;
        let up = |v: &Vec<f32>| st.clone_htod(v).map_err(driver_err("weight upload"));
        let (gs1, gs2) = weights.global_scales(spec.quant);
        let shards = spec.activation.w13_shards();
        let shared = match &weights.shared {
            Some(sh) => Some((
                DeviceProjection::from_dense(st, &sh.w13, shards)?,
                DeviceProjection::from_dense(st, &sh.w2, 1)?,
            )),
            None => None,
        };
        Ok(Self {
            spec: *spec,
            dev,
            w13: DeviceProjection::from_stack(st, &weights.w13)?,
            w2: DeviceProjection::from_stack(st, &weights.w2)?,
            shared,
            router: weights.router.as_ref().map(up).transpose()?,
            router_bf16: match weights
                .router
                .as_ref()
                .and_then(|r| router_bf16_copy(r, spec.shape.experts, spec.shape.hidden))
            {
                Some((w, hp)) => {
                    Some((st.clone_htod(&w).map_err(driver_err("router upload"))?, hp))
                }
                None => None,
            },
            bias: weights
                .e_score_correction_bias
                .as_ref()
                .map(up)
                .transpose()?,
            gs1,
            gs2,
            gemm_path: None,
            route_path: None,
            decode_kernel: None,
            gemm_shape: None,
            expert_handoff: None,
            prefill_feed: None,
            prefill_tile: None,
            router_kernel: None,
            stream_units: None,
            one_token: None,
            one_token_shapes: Mutex::new(Vec::new()),
            stage_limit: None,
        })
    }

    /// Forces the expert-GEMM path of later forwards (`None`: chosen per call, see
    /// [`GemmPath::choose`]). The prefill path still falls back to decode kernels where the
    /// device lacks its shared memory or the weights are bf16.
    pub fn set_gemm_path(&mut self, path: Option<GemmPath>) {
        self.gemm_path = path;
    }

    /// Forces how later forwards route, sort and prepare (`None`: chosen per call, see
    /// [`RoutePath::choose`]). A batch too large for the fused kernel still takes the split
    /// kernels.
    pub fn set_route_path(&mut self, path: Option<RoutePath>) {
        self.route_path = path;
    }

    /// Forces the decode kernels of later forwards' NVFP4 GEMMs (`None`:
    /// [`DecodeKernel::for_tokens`]). Streaming falls back to the mma kernels where its shared
    /// memory does not fit.
    pub fn set_decode_kernel(&mut self, kernel: Option<DecodeKernel>) {
        self.decode_kernel = kernel;
    }

    /// Forces the block shape of later forwards' mma decode GEMMs (`None`: `FP4MOE_GEMM_SHAPE`,
    /// else the default rule). A shape without a kernel for the launch's token subtiles falls
    /// back to the wide one.
    pub fn set_gemm_shape(&mut self, shape: Option<GemmShape>) {
        self.gemm_shape = shape;
    }

    /// Forces the expert-ready handoff between the routed GEMMs on or off (`None`:
    /// `FP4MOE_EXPERT_HANDOFF=0|1`, else on, on the prefill tiles below
    /// [`PREFILL_HANDOFF_BELOW`] tokens per expert). It applies where both routed GEMMs run
    /// `expert_gemm.cu`'s mma kernels or the prefill tiles as programmatic launches (sm_90):
    /// each GEMM2 block waits for its own expert's GEMM1 blocks instead of all of GEMM1.
    /// Results are the same bits.
    pub fn set_expert_handoff(&mut self, on: Option<bool>) {
        self.expert_handoff = on;
    }

    /// Whether a forward of `tokens` tokens runs the expert-ready handoff between its routed
    /// GEMMs ([`Self::set_expert_handoff`]): on where the routed GEMMs run `expert_gemm.cu`'s
    /// mma kernels or the prefill tiles and the device launches programmatic dependents (sm_90).
    pub fn expert_handoff_applies(&self, tokens: usize) -> bool {
        let (e, k) = (self.spec.shape.experts, self.spec.routing.top_k);
        // One token may run as one launch instead.
        tokens > 0
            && !self.one_token_applies(tokens)
            && self.expert_handoff_for(self.path_for(tokens * k, e), &self.w13, &self.w2, tokens)
    }

    /// Whether routed GEMMs over `w13` and `w2` on `path`, `tokens` tokens, hand GEMM1's rows to
    /// GEMM2 per expert: both on kernels that take part (`expert_gemm.cu`'s mma decode kernels,
    /// bf16 weights included, and `prefill_gemm.cu`'s tiles; not the streaming kernels),
    /// launched as dependents, and the whole layer launched (a graph prefix that stops after
    /// GEMM1 would leave counters behind).
    fn expert_handoff_for(
        &self,
        path: GemmPath,
        w13: &DeviceProjection,
        w2: &DeviceProjection,
        tokens: usize,
    ) -> bool {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let forced = self.expert_handoff.or_else(|| {
            tuning_choice(&KNOB, "FP4MOE_EXPERT_HANDOFF", &[("0", false), ("1", true)])
        });
        let (e, k) = (self.spec.shape.experts, self.spec.routing.top_k);
        let nvfp4 = w13.nvfp4 || w2.nvfp4;
        let on = forced.unwrap_or_else(|| handoff_by_default(path, nvfp4, tokens * k, e));
        on && self.dev.pdl
            && !self.stops_after(2)
            && (path == GemmPath::Prefill
                || !nvfp4
                || self.decode_kernel_for(tokens) == DecodeKernel::Mma)
    }

    /// The decode kernel family of a forward of `tokens` tokens: forced (layer, then
    /// `FP4MOE_DECODE_KERNEL`), else [`DecodeKernel::for_tokens`].
    fn decode_kernel_for(&self, tokens: usize) -> DecodeKernel {
        self.decode_kernel
            .or_else(DecodeKernel::from_env)
            .unwrap_or(DecodeKernel::for_tokens(tokens))
    }

    /// Forces how later forwards' prefill tiles receive their activations (`None`: the default,
    /// TMA on sm_90a, cp.async for the 32-token tiles below [`PREFILL_SMALL_TMA_FROM`] tokens per
    /// expert). TMA falls back to cp.async where it does not apply (not sm_90a, a K that is not a
    /// multiple of 8, less than one box of operand rows; the wide and dual tiles then give way
    /// to 128-token ones), and multicast to one-CTA TMA per GEMM where its row tiles do not pair
    /// up (an odd count) and on the wide, dual and 32-token tiles.
    pub fn set_prefill_feed(&mut self, feed: Option<PrefillFeed>) {
        self.prefill_feed = feed;
    }

    /// Forces later forwards' prefill token tile (`None`: [`PrefillTile::choose`]'s default, and
    /// per GEMM the wide tiles for GEMM1 from [`PREFILL_WIDE_TILE_FROM`] tokens per expert).
    /// A tile the device lacks the shared memory for falls back to a smaller one, a wide tile
    /// to the 128-token one where the TMA feed does not apply.
    pub fn set_prefill_tile(&mut self, tile: Option<PrefillTile>) {
        self.prefill_tile = tile;
    }

    /// Forces how later forwards compute router logits from [`CudaLayer::router_tiled_from`]
    /// tokens (`None`: `FP4MOE_ROUTER`, else [`RouterKernel::Bf16`] for a router of bf16
    /// values, [`RouterKernel::Wide`] otherwise). The threshold follows the kernel: 128 tokens
    /// for the bf16 one, 1024 for the others.
    pub fn set_router_kernel(&mut self, kernel: Option<RouterKernel>) {
        self.router_kernel = kernel;
    }

    /// Forces the row-group units per block of the streaming decode kernels (1, 2 or 4; `None`:
    /// chosen once per projection, one wave of blocks for one token where possible). A shape that does not fit in shared
    /// memory falls back to the mma kernels.
    pub fn set_stream_units(&mut self, units: Option<usize>) {
        self.stream_units = units;
    }

    /// Makes later forwards stop after the first `stages` of [`STAGES`] (`None` or 4: the whole
    /// layer). A timing diagnostic (`fp4moe bench --stages` times graphs of each prefix): a cut
    /// forward leaves its output unwritten.
    pub fn set_stage_limit(&mut self, stages: Option<usize>) {
        self.stage_limit = stages;
    }

    /// Whether forwards stop after stage `done` (1-based) of [`STAGES`].
    fn stops_after(&self, done: usize) -> bool {
        self.stage_limit == Some(done)
    }

    /// The layer's forced route path, else `FP4MOE_ROUTE`, else [`RoutePath::choose`]'s rule.
    fn route_path_for(&self, tokens: usize) -> RoutePath {
        let forced = self.route_path.or_else(RoutePath::from_env);
        RoutePath::choose(
            tokens,
            self.spec.routing.top_k,
            self.spec.shape.experts,
            self.dev.max_shared_bytes,
            self.router_tiled_from(),
            forced,
        )
    }

    /// Token count from which this layer computes router logits with a tiled kernel (its
    /// summation order changes there): 128 for a bf16 router, 1024 otherwise, unless forced.
    pub fn router_tiled_from(&self) -> usize {
        router_tiled_from(self.router_kernel())
    }

    /// The layer's router kernel for tiled batches: forced (layer, then `FP4MOE_ROUTER`), else
    /// [`RouterKernel::Bf16`] where the router weights are bf16 values, else
    /// [`RouterKernel::Wide`]; a forced bf16 kernel on an f32 router runs the wide one.
    fn router_kernel(&self) -> RouterKernel {
        match self.router_kernel.or_else(RouterKernel::from_env) {
            Some(RouterKernel::Bf16) | None if self.router_bf16.is_none() => RouterKernel::Wide,
            Some(k) => k,
            None => RouterKernel::Bf16,
        }
    }

    pub fn spec(&self) -> &MoeSpec {
        &self.spec
    }

    /// The router weight `[E, H]` on the device, for routing without caller logits.
    fn router_weight(&self) -> Result<&CudaSlice<f32>> {
        self.router.as_ref().ok_or_else(|| {
            Error::arg(
                "router_logits",
                "the layer has no router weight: pass router logits",
            )
        })
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.dev.stream
    }

    pub fn device(&self) -> &'static Device {
        self.dev
    }

    /// Device bytes a workspace for `tokens` tokens takes (it counts the router's partial sums
    /// from the bf16 router kernel's 128 tokens, as `workspace` allocates for a layer with a
    /// router weight: an upper bound for one without).
    pub fn workspace_bytes(spec: &MoeSpec, tokens: usize) -> usize {
        let (h, i, e, k) = (
            spec.shape.hidden,
            spec.shape.intermediate,
            spec.shape.experts,
            spec.routing.top_k,
        );
        let p = tokens * k;
        let w = spec.shared_intermediate.unwrap_or(0);
        4 * (2 * tokens * h
            + tokens * e
            + router_part_len(tokens, h, e, router_tiled_from(RouterKernel::Bf16))
            + 2 * p
            + 2 * (e + 1)
            + 2 * p
            + p.div_ceil(SORT_CHUNK) * e
            + 1
            + 2
            + one_token::sync_len(h / 16, e)
            + tokens
            + 2 * tokens
            + 2 * e
            // sh_offsets, sh_active, sh_num, and the trace's minimum of one u64.
            + 5)
            + 2 * (2 * tokens * h + 2 * p * h + tokens * h + p * i + tokens * w)
    }

    /// Allocates the device buffers of a forward over `tokens` tokens.
    pub fn workspace(&self, tokens: usize) -> Result<CudaWorkspace> {
        let st = &self.dev.stream;
        let (h, i, e, k) = (
            self.spec.shape.hidden,
            self.spec.shape.intermediate,
            self.spec.shape.experts,
            self.spec.routing.top_k,
        );
        let p = tokens * k;
        let w = self.spec.shared_intermediate.unwrap_or(0);
        let f = |n: usize| {
            st.alloc_zeros::<f32>(n.max(1))
                .map_err(driver_err("workspace allocation"))
        };
        let i32s = |n: usize| {
            st.alloc_zeros::<i32>(n.max(1))
                .map_err(driver_err("workspace allocation"))
        };
        let b16 = |n: usize| {
            st.alloc_zeros::<u16>(n.max(1))
                .map_err(driver_err("workspace allocation"))
        };
        let has_shared = self.shared.is_some();
        // The shared expert as one expert holding every token once with weight 1: fixed for
        // the workspace's token count, so written once here instead of per forward.
        let up_i32 = |v: &[i32]| st.clone_htod(v).map_err(driver_err("workspace allocation"));
        let sh_sorted: Vec<i32> = (0..tokens.max(1) as i32).collect();
        Ok(CudaWorkspace {
            tokens,
            x: f(tokens * h)?,
            logits: f(tokens * e)?,
            // Sized for the lowest tiled threshold whatever this layer's router kernel is now:
            // the kernel can be changed after the workspace exists (`set_router_kernel`), and
            // layers of one spec can share workspaces. Empty for a layer without a router
            // weight (its callers pass logits); the split launch checks the length.
            router_part: f(if self.router.is_some() {
                router_part_len(tokens, h, e, router_tiled_from(RouterKernel::Bf16))
            } else {
                0
            })?,
            ids: i32s(p)?,
            weights: f(p)?,
            out: f(tokens * h)?,
            a: b16(tokens * h)?,
            a_sorted: b16(p * h)?,
            pair_rows: i32s(p)?,
            xs: b16(if has_shared { tokens * h } else { 0 })?,
            offsets: i32s(e + 1)?,
            sorted: i32s(p)?,
            chunk_counts: i32s(p.div_ceil(SORT_CHUNK) * e)?,
            route_ticket: i32s(1)?,
            one_token_sync: i32s(one_token::sync_len(h / 16, e))?,
            one_token_trace: st
                .alloc_zeros::<u64>(one_token::trace_len(self.dev.sms).max(1))
                .map_err(driver_err("workspace allocation"))?,
            active: i32s(e)?,
            num_active: i32s(1)?,
            g: b16(p * i)?,
            o: b16(p * h)?,
            sh_offsets: up_i32(&[0, tokens as i32])?,
            sh_sorted: up_i32(&sh_sorted)?,
            sh_active: up_i32(&[0])?,
            sh_num: up_i32(&[1])?,
            sh_ones: st
                .clone_htod(&vec![1.0f32; tokens.max(1)])
                .map_err(driver_err("workspace allocation"))?,
            sh_g: b16(tokens * w)?,
            sh_o: b16(if has_shared { tokens * h } else { 0 })?,
            gemm_ready: i32s(2 * e)?,
        })
    }

    /// A kernel that waits for its predecessor before anything else, as a dependent launch:
    /// the routing path's (`routing.cu`, `sort_pairs.cu`, `prepare_input.cu`, `route_small.cu`
    /// start with `pdl_enter()`, test `routing_kernels_wait_first`) and `combine` (`pdl_wait()`
    /// first); any other kernel goes through [`Self::launch_serialized`].
    fn launch(
        &self,
        name: &str,
        cfg: LaunchConfig,
        args: impl FnOnce(&mut KernelArgs),
    ) -> Result<()> {
        self.launch_args(name, cfg, self.dev.pdl, args)
    }

    /// A kernel that must not start before its predecessor ends (`one_token.cu`, whose grid
    /// barrier needs all its blocks resident and which has no `pdl_wait`).
    fn launch_serialized(
        &self,
        name: &str,
        cfg: LaunchConfig,
        args: impl FnOnce(&mut KernelArgs),
    ) -> Result<()> {
        self.launch_args(name, cfg, false, args)
    }

    fn launch_args(
        &self,
        name: &str,
        cfg: LaunchConfig,
        pdl: bool,
        args: impl FnOnce(&mut KernelArgs),
    ) -> Result<()> {
        let mut a = KernelArgs::default();
        args(&mut a);
        let mut ptrs = a.pointers();
        // SAFETY: every kernel's arguments are pushed in the order and types of its C signature,
        // with buffers sized by `workspace` for the workspace's token count (checked by
        // callers); `a` owns the values `ptrs` points at until the call returns.
        unsafe { self.launch_ex(name, cfg, 1, pdl, &mut ptrs) }
    }

    /// An expert GEMM (one `GemmParams` argument), as a dependent launch.
    fn launch_gemm(&self, name: &str, cfg: LaunchConfig, params: GemmParams) -> Result<()> {
        let mut args: [*mut c_void; 1] = [&params as *const GemmParams as *mut c_void];
        // SAFETY: every GEMM kernel takes one `GemmParams` by value (the layout of its C struct,
        // `GemmParams` is `repr(C)`); `args` points at it for the duration of the call.
        unsafe { self.launch_ex(name, cfg, 1, self.dev.pdl, &mut args) }
    }

    /// Launches kernel `name`, with programmatic stream serialization when `pdl` (pass
    /// `self.dev.pdl`: sm_90+, unless `FP4MOE_PDL=0`): it may start while the previous kernel
    /// of the stream finishes and waits for it in `pdl_wait()` (common.cuh), which every kernel
    /// launched so calls before touching its predecessor's outputs (the routed GEMM2 on the
    /// expert-ready handoff waits for its expert's GEMM1 blocks instead: gemm_common.cuh).
    /// Captured graphs keep the programmatic edge.
    ///
    /// `cluster` > 1 launches clusters of that many blocks along x (grid x a multiple of it).
    ///
    /// # Safety
    /// `args` must point to the kernel's arguments, in order and with the C types of its
    /// signature, valid for the duration of the call.
    unsafe fn launch_ex(
        &self,
        name: &str,
        cfg: LaunchConfig,
        cluster: u32,
        pdl: bool,
        args: &mut [*mut c_void],
    ) -> Result<()> {
        let f = self.dev.function(name)?;
        let mut attrs: [dsys::CUlaunchAttribute; 2] = std::mem::zeroed();
        let mut n = 0;
        if cluster > 1 {
            attrs[n].id = dsys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
            attrs[n].value.clusterDim.x = cluster;
            attrs[n].value.clusterDim.y = 1;
            attrs[n].value.clusterDim.z = 1;
            n += 1;
        }
        if pdl {
            attrs[n].id =
                dsys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
            attrs[n].value.programmaticStreamSerializationAllowed = 1;
            n += 1;
        }
        let config = dsys::CUlaunchConfig {
            gridDimX: cfg.grid_dim.0,
            gridDimY: cfg.grid_dim.1,
            gridDimZ: cfg.grid_dim.2,
            blockDimX: cfg.block_dim.0,
            blockDimY: cfg.block_dim.1,
            blockDimZ: cfg.block_dim.2,
            sharedMemBytes: cfg.shared_mem_bytes,
            hStream: self.dev.stream.cu_stream(),
            attrs: attrs.as_mut_ptr(),
            numAttrs: n as u32,
        };
        self.dev
            .ctx
            .bind_to_thread()
            .map_err(driver_err("kernel launch"))?;
        dsys::cuLaunchKernelEx(
            &config,
            f.cu_function(),
            args.as_mut_ptr(),
            std::ptr::null_mut(),
        )
        .result()
        .map_err(|e| Error::Cuda {
            stage: "kernel launch",
            message: format!("{name}: {e}"),
        })
    }

    /// Routing on the device: `ws.ids`, `ws.weights` from `logits` (`[T, E]`, or computed from the
    /// router weight when `None`) for the tokens in `ws.x`.
    pub fn route_device(
        &self,
        ws: &mut CudaWorkspace,
        logits: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        if ws.tokens == 0 {
            return Ok(());
        }
        let (t, h, e) = (
            ws.tokens as i32,
            self.spec.shape.hidden as i32,
            self.spec.shape.experts as i32,
        );
        let st = &self.dev.stream;
        let logits_ptr = match logits {
            Some(l) => ptr(l, st),
            None => {
                let router = self.router_weight()?;
                // A warp per logit keeps the latency low for a few tokens; from the tiled
                // threshold a shared-memory tiled kernel reads x and the router weight 32 to
                // 128 times less often: for a bf16 router the bf16 tensor-core tiles from 128
                // tokens (run 69), else from 1024 the wide kernel's 64 x 128 f32 tiles, faster
                // than the 64 x 64 SIMT and the TF32 tiles at every size measured (run 64).
                let kernel = self.router_kernel();
                let (x, l) = (ptr(&ws.x, st), ptr(&ws.logits, st));
                let rp = ptr(router, st);
                let tiled = ws.tokens >= router_tiled_from(kernel);
                if tiled {
                    if let (RouterKernel::Bf16, Some((wb, hp))) = (kernel, &self.router_bf16) {
                        self.router_logits_split_k(ws, RouterKernel::Bf16, x, ptr(wb, st), *hp, l)?;
                        return self.route_topk(ws, l);
                    }
                    if kernel == RouterKernel::Wide {
                        self.router_logits_split_k(ws, RouterKernel::Wide, x, rp, 0, l)?;
                        return self.route_topk(ws, l);
                    }
                }
                let (name, cfg) = if tiled {
                    // Tiles of 64 tokens x 64 experts (SIMT) or 32 x 32 (TF32).
                    let (name, tile, threads) = match kernel {
                        RouterKernel::Simt | RouterKernel::Wide | RouterKernel::Bf16 => {
                            ("router_logits_tiled", (64, 64), 256)
                        }
                        RouterKernel::Tf32x3 => {
                            ("router_logits_tf32x3", (32, 32), ROUTER_TF32_THREADS)
                        }
                    };
                    let cfg = LaunchConfig {
                        grid_dim: ((t as u32).div_ceil(tile.0), (e as u32).div_ceil(tile.1), 1),
                        block_dim: (threads, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    (name, cfg)
                } else {
                    // 32 warps for sliced logits, 8 (a logit each) beyond: the launch shape of
                    // the warp-per-logit kernel before slicing (KERNEL_NOTES run 32).
                    let n = ws.tokens * self.spec.shape.experts;
                    let warps = if n <= ROUTER_SLICED_MAX_LOGITS { 32 } else { 8 };
                    let per_block = warps / router_slices(n);
                    let cfg = LaunchConfig {
                        grid_dim: (n.div_ceil(per_block) as u32, 1, 1),
                        block_dim: (warps as u32 * 32, 1, 1),
                        shared_mem_bytes: 0,
                    };
                    ("router_logits", cfg)
                };
                self.launch(name, cfg, |b| {
                    b.arg(&x).arg(&rp).arg(&l).arg(&t).arg(&h).arg(&e);
                })?;
                l
            }
        };
        self.route_topk(ws, logits_ptr)
    }

    /// The 64 x 128 router tiles into `logits`, through `ws.router_part` and
    /// `router_sum_splits` where they split k: `router_logits_wide` (`router` the f32 weight)
    /// or `router_logits_bf16` (`router` the bf16 copy, `hidden_pad` its row stride).
    fn router_logits_split_k(
        &self,
        ws: &CudaWorkspace,
        kernel: RouterKernel,
        x: u64,
        router: u64,
        hidden_pad: usize,
        logits: u64,
    ) -> Result<()> {
        let st = &self.dev.stream;
        let (tokens, hidden, experts) =
            (ws.tokens, self.spec.shape.hidden, self.spec.shape.experts);
        let bf16 = kernel == RouterKernel::Bf16;
        let (splits, k_split) = if bf16 {
            router_bf16_splits(tokens, hidden, experts)
        } else {
            router_wide_splits(tokens, hidden, experts)
        };
        let out = if splits > 1 {
            // The kernel writes `splits` slices of T·E partial sums.
            if ws.router_part.len() < splits * tokens * experts {
                return Err(Error::arg(
                    "workspace",
                    "router_part is too small for this router kernel's k split: \
                     allocate the workspace with this layer's spec",
                ));
            }
            ptr(&ws.router_part, st)
        } else {
            logits
        };
        let (name, threads, shared) = if bf16 {
            (
                "router_logits_bf16",
                ROUTER_BF16_THREADS,
                ROUTER_BF16_SHARED,
            )
        } else {
            (
                "router_logits_wide",
                ROUTER_WIDE_THREADS,
                ROUTER_WIDE_SHARED,
            )
        };
        let cfg = LaunchConfig {
            grid_dim: (
                tokens.div_ceil(ROUTER_WIDE_TILE.0) as u32,
                experts.div_ceil(ROUTER_WIDE_TILE.1) as u32,
                splits as u32,
            ),
            block_dim: (threads, 1, 1),
            shared_mem_bytes: shared,
        };
        let (t, h, hp, e, ks) = (
            tokens as i32,
            hidden as i32,
            hidden_pad as i32,
            experts as i32,
            k_split as i32,
        );
        self.launch(name, cfg, |b| {
            b.arg(&x).arg(&router).arg(&out).arg(&t).arg(&h);
            if bf16 {
                b.arg(&hp);
            }
            b.arg(&e).arg(&ks);
        })?;
        if splits > 1 {
            let n = (tokens * experts) as i32;
            let s = splits as i32;
            let cfg = LaunchConfig {
                grid_dim: ((n as u32).div_ceil(256).min(4 * self.dev.sms as u32), 1, 1),
                block_dim: (256, 1, 1),
                shared_mem_bytes: 0,
            };
            self.launch("router_sum_splits", cfg, |b| {
                b.arg(&out).arg(&logits).arg(&n).arg(&s);
            })?;
        }
        Ok(())
    }

    /// `route_topk`: `ws.ids`, `ws.weights` from the `[T, E]` logits at `logits_ptr`.
    fn route_topk(&self, ws: &CudaWorkspace, logits_ptr: u64) -> Result<()> {
        let st = &self.dev.stream;
        let r = self.spec.routing;
        let (t, e) = (ws.tokens as i32, self.spec.shape.experts as i32);
        let bias = self.bias.as_ref().map_or(0u64, |b| ptr(b, st));
        let (ids, w) = (ptr(&ws.ids, st), ptr(&ws.weights, st));
        let (k, scoring) = (r.top_k as i32, i32::from(r.scoring == Scoring::Sigmoid));
        let (ng, tg, renorm, rsf) = (
            r.n_group as i32,
            r.topk_group as i32,
            i32::from(r.renormalize),
            r.routed_scaling_factor,
        );
        let cfg = LaunchConfig {
            grid_dim: ((t as u32).div_ceil(4), 1, 1),
            block_dim: (128, 1, 1),
            shared_mem_bytes: 4 * 4 * (2 * e as u32 + 64),
        };
        self.launch("route_topk", cfg, |b| {
            b.arg(&logits_ptr)
                .arg(&bias)
                .arg(&ids)
                .arg(&w)
                .arg(&t)
                .arg(&e)
                .arg(&k)
                .arg(&scoring)
                .arg(&ng)
                .arg(&tg)
                .arg(&renorm)
                .arg(&rsf);
        })
    }

    /// Token subtiles (8 tokens each) per pass ([`subtiles_wanted`]; `gated`: the kernel's
    /// two weight rows per output, for its shared memory), never more than shared memory allows.
    /// `FP4MOE_DECODE_NSUB=1|2|4` asks for another count (a benchmark knob; shared memory still
    /// bounds it).
    fn nsub(&self, tokens: usize, k: usize, gated: bool, shape: GemmShape) -> usize {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let per_expert = (tokens * self.spec.routing.top_k)
            .div_ceil(self.spec.shape.experts)
            .max(1);
        let forced = tuning_choice(&KNOB, "FP4MOE_DECODE_NSUB", &[("1", 1), ("2", 2), ("4", 4)]);
        let gated_layer = self.spec.activation.is_gated();
        let want =
            forced.unwrap_or_else(|| subtiles_wanted(tokens, per_expert, gated_layer, shape));
        [4, 2, 1]
            .into_iter()
            .filter(|&n| n <= want)
            .find(|&n| gemm_smem(n, k, gated, shape) <= self.dev.max_shared_bytes)
            .unwrap_or(1)
    }

    /// One decode GEMM: `stream` (the `expert_stream.cu` kernel family of an NVFP4 projection)
    /// where chosen and its shared memory fits, else `expert_gemm.cu`'s `name`. Returns the
    /// mma kernel's blocks per expert (grid x), 0 for a streaming kernel.
    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        name: &str,
        stream: Option<&str>,
        proj: &DeviceProjection,
        params: GemmParams,
        rg_out: usize,
        slots: usize,
        tokens: usize,
        one_token_slots: usize,
    ) -> Result<u32> {
        let gated = name.contains("gated");
        let kernel = self.decode_kernel_for(tokens);
        let streaming = match (stream, kernel) {
            (Some(stream), DecodeKernel::Stream) => self
                .stream_shape(stream, proj, gated, rg_out, tokens, one_token_slots)
                .map(|sh| (stream, sh)),
            _ => None,
        };
        if let Some((stream, sh)) = streaming {
            let cfg = LaunchConfig {
                grid_dim: (rg_out.div_ceil(sh.rb) as u32, slots as u32, 1),
                block_dim: (STREAM_THREADS as u32, 1, 1),
                shared_mem_bytes: sh.smem as u32,
            };
            let params = GemmParams {
                tile_rows: tokens.clamp(1, STREAM_TILE) as i32,
                ..params
            };
            return self
                .launch_gemm(&format!("{stream}_r{}", sh.rb), cfg, params)
                .map(|()| 0);
        }
        let shape = GemmShape::chosen(
            tokens,
            slots,
            self.gemm_shape,
            name.starts_with("gemm1"),
            self.spec.activation.is_gated(),
            proj.nvfp4,
        );
        let nsub = self.nsub(tokens, proj.k, gated, shape);
        let kname = format!("{name}_{}_n{nsub}", shape.name(nsub));
        let smem = gemm_smem(nsub, proj.k, gated, shape) as u32;
        if smem as usize > self.dev.max_shared_bytes {
            return Err(Error::Unsupported {
                backend: "cuda".into(),
                reason: format!(
                    "K = {} needs {smem} bytes of shared memory per block; the device allows {}",
                    proj.k, self.dev.max_shared_bytes
                ),
            });
        }
        // The kernels stage activation rows by 16-byte cp.async: every row must start 16-byte
        // aligned (the spec's multiples of 16 and buffers that start allocations make it so).
        if params.act % 16 != 0 || params.k % 8 != 0 {
            return Err(Error::Cuda {
                stage: "expert GEMMs",
                message: format!(
                    "internal: {kname} needs 16-byte aligned activation rows (K = {})",
                    params.k
                ),
            });
        }
        let blocks = rg_out.div_ceil(shape.rgpb(nsub)) as u32;
        let cfg = LaunchConfig {
            grid_dim: (blocks, slots as u32, 1),
            block_dim: ((shape.warps(nsub) * 32) as u32, 1, 1),
            shared_mem_bytes: smem,
        };
        self.launch_gemm(&kname, cfg, params).map(|()| blocks)
    }

    /// The streaming launch shape for `tokens` tokens, or `None` when it does not fit. Units per
    /// block: forced (layer, then `FP4MOE_STREAM_UNITS`), else [`StreamShape::choose`]'s for one
    /// token (`one_token_slots` experts), chosen once per projection: a property of the layer,
    /// not of the batch, so a token's bits do not depend on the batch (the units per block set
    /// the K split), and no occupancy query runs per forward.
    fn stream_shape(
        &self,
        stream: &str,
        proj: &DeviceProjection,
        gated: bool,
        rg_out: usize,
        tokens: usize,
        one_token_slots: usize,
    ) -> Option<StreamShape> {
        let max = self.dev.max_shared_bytes;
        let rb = match self.stream_units.or_else(StreamShape::from_env) {
            Some(rb) => rb,
            None => {
                (*proj.stream_units.get_or_init(|| {
                    let one = StreamShape::candidates(proj.k, gated, 1, max);
                    StreamShape::choose(
                        &one,
                        |c| rg_out.div_ceil(c.rb) * one_token_slots,
                        |c| self.stream_resident(stream, c),
                    )
                    .map(|c| c.rb)
                }))?
            }
        };
        StreamShape::new(rb, proj.k, gated, tokens, max)
    }

    /// Blocks of streaming kernel family `stream` in shape `c` the whole device holds at once
    /// (0 when the driver cannot say).
    fn stream_resident(&self, stream: &str, c: &StreamShape) -> usize {
        let per_sm = self
            .dev
            .function(&format!("{stream}_r{}", c.rb))
            .ok()
            .and_then(|f| {
                f.occupancy_max_active_blocks_per_multiprocessor(
                    STREAM_THREADS as u32,
                    c.smem,
                    None,
                )
                .ok()
            })
            .unwrap_or(0);
        per_sm as usize * self.dev.sms
    }

    /// The layer's forced path, else `FP4MOE_GEMM_PATH`, else [`GemmPath::choose`]'s rule.
    fn path_for(&self, pairs: usize, experts: usize) -> GemmPath {
        let forced = self.gemm_path.or_else(GemmPath::from_env);
        let gated = self.spec.activation.is_gated();
        GemmPath::choose(pairs, experts, gated, self.dev.max_shared_bytes, forced)
    }

    /// One prefill GEMM (`prefill_gemm.cu`): grid x over the tile's weight-row tiles
    /// ([`PrefillTile::row_groups`] row groups each), grid y over an upper bound of the (expert,
    /// token tile) work items of `pairs` pairs spread over at most `slots` experts.
    /// With a TMA `feed`, `sorted_rows` are the activation rows in sorted order. Returns the
    /// row tiles (grid x): the blocks of each token tile.
    #[allow(clippy::too_many_arguments)]
    fn prefill_gemm(
        &self,
        gemm: PrefillGemm,
        tile: PrefillTile,
        feed: PrefillFeed,
        sorted_rows: SortedRows,
        params: GemmParams,
        rg_out: usize,
        pairs: usize,
        slots: usize,
    ) -> Result<usize> {
        let tiles = prefill_token_tiles(tile, pairs, slots)?;
        let name = gemm.kernel(tile, feed).ok_or_else(|| Error::Cuda {
            stage: "kernel launch",
            message: format!("no prefill kernel runs {tile:?} tiles fed by {feed:?}"),
        })?;
        let cluster = feed.cluster();
        let row_tiles = rg_out.div_ceil(tile.row_groups(gemm));
        if row_tiles % cluster as usize != 0 {
            return Err(Error::Cuda {
                stage: "kernel launch",
                message: format!(
                    "{name}: {row_tiles} row tiles do not pair into clusters of {cluster}"
                ),
            });
        }
        let cfg = LaunchConfig {
            grid_dim: (row_tiles as u32, tiles as u32, 1),
            block_dim: (tile.threads() as u32, 1, 1),
            shared_mem_bytes: tile.shared_bytes() as u32,
        };
        if feed == PrefillFeed::CpAsync {
            return self.launch_gemm(name, cfg, params).map(|_| row_tiles);
        }
        let map =
            tensor_map(sorted_rows, params.k as usize, tile.box_rows()).map_err(|e| match e {
                Error::Cuda { stage, message } => Error::Cuda {
                    stage,
                    message: format!("{name}: {message}"),
                },
                e => e,
            })?;
        let mut args: [*mut c_void; 2] = [
            &params as *const GemmParams as *mut c_void,
            &map as *const dsys::CUtensorMap as *mut c_void,
        ];
        // SAFETY: the TMA kernels take (GemmParams, CUtensorMap) by value; both live on this
        // frame for the duration of the call. The map covers `sorted_rows.rows` rows of
        // `sorted_rows.stride` bf16 inside a workspace buffer (`a_sorted`, `xs`, `g`, `sh_g`)
        // that outlives the launch and any graph replaying it; the TMA never reads past it.
        unsafe { self.launch_ex(name, cfg, cluster, self.dev.pdl, &mut args) }?;
        Ok(row_tiles)
    }

    /// The tile and activation feed of one prefill GEMM of reduction length `k` and `rg` output
    /// row groups over `pairs` pairs of at most `slots` experts (wide and dual tiles need the
    /// TMA feed).
    fn prefill_plan(
        &self,
        gemm: PrefillGemm,
        k: usize,
        rg: usize,
        pairs: usize,
        slots: usize,
    ) -> (PrefillTile, PrefillFeed) {
        let forced_tile = self.prefill_tile.or_else(PrefillTile::from_env);
        let tile = PrefillTile::choose(pairs, slots, self.dev.max_shared_bytes, forced_tile);
        let forced = self.prefill_feed.or_else(PrefillFeed::from_env);
        let per_expert = pairs / slots.max(1);
        let choose = |tile: PrefillTile| {
            let row_tiles = rg.div_ceil(tile.row_groups(gemm));
            PrefillFeed::choose(
                tile,
                per_expert,
                k,
                pairs,
                row_tiles,
                &self.dev.arch,
                forced,
            )
        };
        let tile = match forced_tile {
            None => tile.for_gemm(gemm, k, per_expert, self.dev.max_shared_bytes),
            Some(_) => tile,
        };
        let tile = tile.for_feed(choose(tile));
        (tile, choose(tile))
    }

    /// GEMM1's prefill kernel for this layer's activation.
    fn prefill_gemm1(&self) -> PrefillGemm {
        if self.spec.activation.is_gated() {
            PrefillGemm::Gemm1Gated
        } else {
            PrefillGemm::Gemm1Plain
        }
    }

    /// Whether the routed GEMM1 of a `tokens`-token batch reads its operand in sorted pair order
    /// (`a_sorted`: NVFP4 weights on the prefill path with a TMA feed), so that the input
    /// preparation writes it there directly (`prepare_input_sorted`) instead of `gather_rows`
    /// copying it from `a`.
    fn gemm1_reads_sorted(&self, tokens: usize) -> bool {
        let (e, pairs) = (self.spec.shape.experts, tokens * self.spec.routing.top_k);
        let slots = pairs.min(e);
        let (h, rg1) = (self.spec.shape.hidden, self.spec.shape.intermediate / 16);
        self.w13.nvfp4
            && self.path_for(pairs, e) == GemmPath::Prefill
            && self
                .prefill_plan(self.prefill_gemm1(), h, rg1, pairs, slots)
                .1
                != PrefillFeed::CpAsync
    }

    /// GEMM1 then GEMM2 of one projection pair through the path `path` (bf16 weights always
    /// take the decode kernels). `gathered`: for the routed experts, `a_sorted` and whether the
    /// input preparation already wrote it (else `gather_rows` does, where GEMM1 reads it).
    #[allow(clippy::too_many_arguments)]
    fn expert_gemms(
        &self,
        path: GemmPath,
        w13: &DeviceProjection,
        w2: &DeviceProjection,
        p1: GemmParams,
        p2: GemmParams,
        pairs: usize,
        slots: usize,
        tokens: usize,
        gathered: Option<(u64, bool)>,
    ) -> Result<()> {
        let routed = gathered.is_some();
        let gated = self.spec.activation.is_gated();
        let kind = |proj: &DeviceProjection| if proj.nvfp4 { "nvfp4" } else { "bf16" };
        // Experts a one-token batch touches: top-k routed, the one shared expert.
        let one_token_slots = if routed { self.spec.routing.top_k } else { 1 };
        let (rg1, rg2) = (p1.rg_out as usize, p2.rg_out as usize);
        let gemm1 = self.prefill_gemm1();
        let (tile1, feed1) = self.prefill_plan(gemm1, p1.k as usize, rg1, pairs, slots);
        let (tile2, feed2) =
            self.prefill_plan(PrefillGemm::Gemm2, p2.k as usize, rg2, pairs, slots);
        // bf16 weights always take the decode kernels.
        let prefill1 = path == GemmPath::Prefill && w13.nvfp4;
        let prefill2 = path == GemmPath::Prefill && w2.nvfp4;
        let reads_sorted = prefill1 && feed1 != PrefillFeed::CpAsync;
        if let Some((_, true)) = gathered {
            // The input preparation wrote only `a_sorted`: `a` holds nothing for another path.
            if !reads_sorted {
                return Err(Error::Cuda {
                    stage: "expert GEMMs",
                    message: "internal: operand prepared in sorted order for a GEMM1 that reads it by token".into(),
                });
            }
        }
        // The expert-ready handoff (gemm_common.cuh) between the routed GEMMs (`routed_params`
        // points both at the counters); elsewhere no kernel touches them.
        let handoff = routed && self.expert_handoff_for(path, w13, w2, tokens);
        let ready = if handoff { p1.ready } else { 0 };
        let (p1, p2) = (GemmParams { ready, ..p1 }, GemmParams { ready, ..p2 });
        // Both grids are checked before either GEMM launches (the tiles may differ).
        if prefill1 {
            prefill_token_tiles(tile1, pairs, slots)?;
        }
        if prefill2 {
            prefill_token_tiles(tile2, pairs, slots)?;
        }
        // GEMM1's blocks per expert (per token tile of `nt1` rows on the prefill tiles; 0 for a
        // streaming kernel, which does not signal).
        let (blocks1, nt1) = if prefill1 {
            let gemm = gemm1;
            // The routed operand's rows in sorted order; the shared expert's already are.
            let mut rows = SortedRows {
                ptr: p1.act,
                rows: pairs,
                stride: p1.k as usize,
            };
            if let (Some((dst, prepared)), true) = (gathered, reads_sorted) {
                if !prepared {
                    self.gather_rows(p1, dst, pairs)?;
                }
                rows.ptr = dst;
            }
            let row_tiles = self.prefill_gemm(gemm, tile1, feed1, rows, p1, rg1, pairs, slots)?;
            (row_tiles, tile1.tokens())
        } else {
            let name = format!(
                "gemm1_{}_{}",
                kind(w13),
                if gated { "gated" } else { "plain" }
            );
            let stream = match (w13.nvfp4, gated) {
                (false, _) => None,
                (true, true) => Some("stream_gemm1_gated"),
                (true, false) => Some("stream_gemm1_plain"),
            };
            let blocks = self.gemm(&name, stream, w13, p1, rg1, slots, tokens, one_token_slots)?;
            (blocks as usize, 0)
        };
        if routed && self.stops_after(2) {
            return Ok(());
        }
        // GEMM1 signalled per expert only if it ran signalling kernels (blocks1 > 0), which the
        // handoff's rule makes so.
        let signalled = ready != 0 && blocks1 > 0;
        let p2 = GemmParams {
            wait_blocks: if signalled { blocks1 as i32 } else { 0 },
            wait_nt: if signalled { nt1 as i32 } else { 0 },
            ready: if signalled { ready } else { 0 },
            ..p2
        };
        let launched = if prefill2 {
            // GEMM2's operand is GEMM1's output, written in sorted order.
            let rows = SortedRows {
                ptr: p2.act,
                rows: pairs,
                stride: p2.k as usize,
            };
            self.prefill_gemm(
                PrefillGemm::Gemm2,
                tile2,
                feed2,
                rows,
                p2,
                rg2,
                pairs,
                slots,
            )
            .map(|_| ())
        } else {
            let stream = w2.nvfp4.then_some("stream_gemm2");
            let name = format!("gemm2_{}", kind(w2));
            self.gemm(&name, stream, w2, p2, rg2, slots, tokens, one_token_slots)
                .map(|_| ())
        };
        if launched.is_err() && signalled {
            // GEMM1 counted its blocks and no GEMM2 will zero the counters: zero them here so
            // the next forward's GEMM2 does not wait for counts it never reaches.
            let n = 2 * p1.experts.max(0) as usize;
            // SAFETY: `ready` is the workspace's `gemm_ready` buffer of 2·E i32 (p1.experts = E
            // for routed GEMMs), on this stream.
            let _ = unsafe { dsys::cuMemsetD32Async(ready, 0, n, self.dev.stream.cu_stream()) };
        }
        launched
    }

    /// `dst[i] = act[sorted[i] / top_k]` for the `pairs` sorted pairs of `p1` (`gather_rows`).
    fn gather_rows(&self, p1: GemmParams, dst: u64, pairs: usize) -> Result<()> {
        let cfg = LaunchConfig {
            grid_dim: (pairs.div_ceil(8) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        let (n, k, h) = (pairs as i32, p1.top_k, p1.k);
        self.launch("gather_rows", cfg, |b| {
            b.arg(&p1.act)
                .arg(&p1.sorted)
                .arg(&dst)
                .arg(&n)
                .arg(&k)
                .arg(&h);
        })
    }

    /// Groups the `pairs` routed pairs of `ws.ids` by expert into `grouping` (`sort_pairs.cu`):
    /// one block up to `2·SORT_CHUNK` pairs, else count / scan / place over `SORT_CHUNK`-pair
    /// chunks.
    fn sort_pairs(
        &self,
        ws: &CudaWorkspace,
        grouping: Grouping,
        pairs: i32,
        experts: i32,
    ) -> Result<()> {
        let st = &self.dev.stream;
        let ids = ptr(&ws.ids, st);
        let Grouping {
            offsets: off,
            sorted,
            active,
            num_active: num,
            ..
        } = grouping;
        let block = |grid: usize, smem: usize| LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: (4 * smem) as u32,
        };
        let e = experts as usize;
        if pairs as usize <= SORT_ONE_BLOCK_MAX {
            return self.launch("sort_pairs", block(1, 33 * e), |b| {
                b.arg(&ids)
                    .arg(&pairs)
                    .arg(&experts)
                    .arg(&off)
                    .arg(&sorted)
                    .arg(&active)
                    .arg(&num);
            });
        }
        let chunks = (pairs as usize).div_ceil(SORT_CHUNK);
        let (chunk, nchunks) = (SORT_CHUNK as i32, chunks as i32);
        let counts = ptr(&ws.chunk_counts, st);
        self.launch("count_pairs", block(chunks, 32 * e), |b| {
            b.arg(&ids)
                .arg(&pairs)
                .arg(&experts)
                .arg(&chunk)
                .arg(&counts);
        })?;
        self.launch("scan_pair_counts", block(1, e), |b| {
            b.arg(&counts)
                .arg(&nchunks)
                .arg(&experts)
                .arg(&off)
                .arg(&active)
                .arg(&num);
        })?;
        self.launch("place_pairs", block(chunks, 32 * e), |b| {
            b.arg(&ids)
                .arg(&pairs)
                .arg(&experts)
                .arg(&chunk)
                .arg(&counts)
                .arg(&sorted);
        })
    }

    /// The routed pairs' grouping by expert in `ws`, as both GEMMs read it.
    fn grouping(&self, ws: &CudaWorkspace) -> Grouping {
        let st = &self.dev.stream;
        Grouping {
            offsets: ptr(&ws.offsets, st),
            sorted: ptr(&ws.sorted, st),
            active: ptr(&ws.active, st),
            num_active: ptr(&ws.num_active, st),
            experts: self.spec.shape.experts as i32,
        }
    }

    /// Split path after routing: groups the pairs of `ws.ids` by expert (`sort_pairs.cu`) and
    /// prepares the GEMM operand from `ws.x`: `ws.a`, or, with `sorted`, GEMM1's rows in sorted
    /// pair order `ws.a_sorted` ([`CudaLayer::gemm1_reads_sorted`]); `ws.xs` for the shared
    /// expert either way.
    fn group_device(&self, ws: &CudaWorkspace, sorted: bool) -> Result<()> {
        let st = &self.dev.stream;
        let s = &self.spec;
        let (t, h) = (ws.tokens, s.shape.hidden);
        let p = t * s.routing.top_k;
        self.sort_pairs(ws, self.grouping(ws), p as i32, s.shape.experts as i32)?;
        let (x, a) = (ptr(&ws.x, st), ptr(&ws.a, st));
        let xs = if self.shared.is_some() {
            ptr(&ws.xs, st)
        } else {
            0u64
        };
        let gs = self.gs1.unwrap_or(0.0);
        let hid = h as i32;
        let cfg = LaunchConfig {
            grid_dim: (t as u32, 1, 1),
            // 256 threads: a few tokens' rows take a few loop trips each, not ~20.
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        if !sorted {
            return self.launch("prepare_input", cfg, |b| {
                b.arg(&x).arg(&a).arg(&xs).arg(&hid).arg(&gs);
            });
        }
        let (srt, rows, a_sorted) = (
            ptr(&ws.sorted, st),
            ptr(&ws.pair_rows, st),
            ptr(&ws.a_sorted, st),
        );
        let n = p as i32;
        let invert = LaunchConfig {
            grid_dim: (p.div_ceil(256) as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        self.launch("invert_pairs", invert, |b| {
            b.arg(&srt).arg(&rows).arg(&n);
        })?;
        let k = s.routing.top_k as i32;
        self.launch("prepare_input_sorted", cfg, |b| {
            b.arg(&x)
                .arg(&a_sorted)
                .arg(&xs)
                .arg(&rows)
                .arg(&hid)
                .arg(&gs)
                .arg(&k);
        })
    }

    /// The layer's selection rule for the routing kernels.
    fn selection(&self) -> Selection {
        let r = &self.spec.routing;
        Selection {
            experts: self.spec.shape.experts as i32,
            top_k: r.top_k as i32,
            scoring: i32::from(r.scoring == Scoring::Sigmoid),
            n_group: r.n_group as i32,
            topk_group: r.topk_group as i32,
            renormalize: i32::from(r.renormalize),
        }
    }

    /// The routing's pointers over `ws` for `source`.
    fn route_io(&self, ws: &CudaWorkspace, source: RouteSource) -> Result<RouteIo> {
        let st = &self.dev.stream;
        let (router, logits) = match source {
            RouteSource::Router => (ptr(self.router_weight()?, st), ptr(&ws.logits, st)),
            RouteSource::Logits(l) => (0u64, ptr(l, st)),
            RouteSource::Ids => (0u64, 0u64),
        };
        Ok(RouteIo {
            x: ptr(&ws.x, st),
            router,
            logits,
            bias: self.bias.as_ref().map_or(0u64, |b| ptr(b, st)),
            ids: ptr(&ws.ids, st),
            weights: ptr(&ws.weights, st),
        })
    }

    /// Fused path (`route_small.cu`, one launch): routing from `source`, then what
    /// [`CudaLayer::group_device`] does. The caller checked [`RoutePath::choose`]'s limits.
    fn route_small(&self, ws: &CudaWorkspace, source: RouteSource) -> Result<()> {
        let st = &self.dev.stream;
        let s = &self.spec;
        let r = s.routing;
        let (t, e) = (ws.tokens, s.shape.experts);
        let params = RouteSmallParams {
            io: self.route_io(ws, source)?,
            a: ptr(&ws.a, st),
            xs: if self.shared.is_some() {
                ptr(&ws.xs, st)
            } else {
                0u64
            },
            ticket: ptr(&ws.route_ticket, st),
            mode: source.mode(),
            tokens: t as i32,
            hidden: s.shape.hidden as i32,
            select: self.selection(),
            topk_warps: route_topk_warps(t) as i32,
            rsf: r.routed_scaling_factor,
            gs: self.gs1.unwrap_or(0.0),
            ..self.grouping(ws).route_params()
        };
        // One warp per logit when computing them; otherwise the one continuing block only.
        let (grid, selects) = match source {
            RouteSource::Router => ((t * e).div_ceil(router_logits_per_block(t * e)), true),
            RouteSource::Logits(_) => (1, true),
            RouteSource::Ids => (1, false),
        };
        let cfg = LaunchConfig {
            grid_dim: (grid as u32, 1, 1),
            block_dim: (1024, 1, 1),
            shared_mem_bytes: route_small_smem(t, e, selects) as u32,
        };
        self.launch("route_small", cfg, |b| {
            b.arg(&params);
        })
    }

    /// The experts for the routing in `ws.ids` / `ws.weights`: `ws.out = Σ w · expert(x) + shared(x)`.
    pub fn experts_device(&self, ws: &mut CudaWorkspace) -> Result<()> {
        if ws.tokens == 0 {
            return Ok(()); // a zero-sized grid is not a valid launch
        }
        let sorted = match self.route_path_for(ws.tokens) {
            RoutePath::Fused => {
                self.route_small(ws, RouteSource::Ids)?;
                false
            }
            RoutePath::Split => {
                let sorted = self.gemm1_reads_sorted(ws.tokens);
                self.group_device(ws, sorted)?;
                sorted
            }
        };
        self.gemms_device(ws, sorted)
    }

    /// `GemmParams` of projection `proj` without the per-GEMM fields.
    fn projection_params(&self, proj: &DeviceProjection) -> GemmParams {
        let st = &self.dev.stream;
        let act = self.spec.activation;
        let act_id = crate::spec::Activation::ALL
            .iter()
            .position(|a| *a == act)
            .unwrap_or(0) as i32;
        GemmParams {
            wdata: ptr(&proj.data, st),
            wscales: ptr(&proj.scales, st),
            wscale2: ptr(&proj.scale_2, st),
            kg: (pack::padded_k(proj.k) / 64) as i32,
            k: proj.k as i32,
            shards: proj.shards as i32,
            rg_w: (proj.rows / 16) as i32,
            activation: act_id,
            ..Default::default()
        }
    }

    /// The routed experts' GEMM1 and GEMM2 parameters over `ws` (its grouping, `ws.a` as
    /// GEMM1's operand, `ws.g` between the GEMMs, `ws.o` the pairs' outputs).
    fn routed_params(&self, ws: &CudaWorkspace) -> (GemmParams, GemmParams) {
        let st = &self.dev.stream;
        let s = &self.spec;
        let (h, i, k) = (s.shape.hidden, s.shape.intermediate, s.routing.top_k);
        let grouping = self.grouping(ws);
        let (g, o, tw) = (ptr(&ws.g, st), ptr(&ws.o, st), ptr(&ws.weights, st));
        let ready = ptr(&ws.gemm_ready, st);
        let p1 = GemmParams {
            act: ptr(&ws.a, st),
            ready,
            g_out: g,
            rg_out: (i / 16) as i32,
            top_k: k as i32,
            out_stride: i as i32,
            act_alpha: self.gs1.map_or(1.0, |gs| 1.0 / gs),
            gs_out: self.gs2.unwrap_or(0.0),
            ..grouping.params(self.projection_params(&self.w13))
        };
        let p2 = GemmParams {
            act: g,
            topk_w: tw,
            o_out: o,
            ready,
            rg_out: (h / 16) as i32,
            top_k: 0,
            out_stride: h as i32,
            act_alpha: self.gs2.map_or(1.0, |gs| 1.0 / gs),
            ..grouping.params(self.projection_params(&self.w2))
        };
        (p1, p2)
    }

    /// Expert GEMMs, shared expert and combine over a grouped and prepared batch (`ws.offsets`
    /// … and `ws.a` / `ws.xs` written by [`CudaLayer::group_device`] or `route_small`; with
    /// `sorted`, `ws.a_sorted` in place of `ws.a`).
    fn gemms_device(&self, ws: &CudaWorkspace, sorted: bool) -> Result<()> {
        if self.stops_after(1) {
            return Ok(());
        }
        let st = &self.dev.stream;
        let s = &self.spec;
        let (t, h, e, k) = (ws.tokens, s.shape.hidden, s.shape.experts, s.routing.top_k);
        let p = t * k;
        let hid = h as i32;
        let slots = p.min(e);
        let path = self.path_for(p, e);
        let (p1, p2) = self.routed_params(ws);
        let gathered = Some((ptr(&ws.a_sorted, st), sorted));
        self.expert_gemms(path, &self.w13, &self.w2, p1, p2, p, slots, t, gathered)?;
        if self.stops_after(2) {
            return Ok(());
        }

        let mut sh_o = 0u64;
        if let Some((s13, s2)) = &self.shared {
            let width = s.shared_intermediate.unwrap_or(0);
            let sh = Grouping {
                offsets: ptr(&ws.sh_offsets, st),
                sorted: ptr(&ws.sh_sorted, st),
                active: ptr(&ws.sh_active, st),
                num_active: ptr(&ws.sh_num, st),
                experts: 1,
            };
            let ones = ptr(&ws.sh_ones, st);
            let (sg, xs_p) = (ptr(&ws.sh_g, st), ptr(&ws.xs, st));
            sh_o = ptr(&ws.sh_o, st);
            let q1 = GemmParams {
                act: xs_p,
                g_out: sg,
                rg_out: (width / 16) as i32,
                top_k: 1,
                out_stride: width as i32,
                act_alpha: 1.0,
                gs_out: 0.0,
                ..sh.params(self.projection_params(s13))
            };
            let q2 = GemmParams {
                act: sg,
                topk_w: ones,
                o_out: sh_o,
                rg_out: (h / 16) as i32,
                top_k: 0,
                out_stride: h as i32,
                act_alpha: 1.0,
                ..sh.params(self.projection_params(s2))
            };
            let path = self.path_for(t, 1);
            self.expert_gemms(path, s13, s2, q1, q2, t, 1, t, None)?;
        }
        if self.stops_after(3) {
            return Ok(());
        }

        let (o, y) = (p2.o_out, ptr(&ws.out, st));
        let (tt, kk) = (t as i32, k as i32);
        let cfg = combine_launch(t, h);
        // `combine(const bf16*, const bf16*, float*, int, int, int)`.
        self.launch("combine", cfg, |b| {
            b.arg(&o).arg(&sh_o).arg(&y).arg(&tt).arg(&kk).arg(&hid);
        })
    }

    /// The whole layer on the device: routing (from `logits` or the router weight) and experts,
    /// reading `ws.x` and writing `ws.out`, `ws.ids`, `ws.weights`. Enqueues work on
    /// [`CudaLayer::stream`] only; no host synchronization, so it can be captured in a graph.
    pub fn forward_device(
        &self,
        ws: &mut CudaWorkspace,
        logits: Option<&CudaSlice<f32>>,
    ) -> Result<()> {
        if ws.tokens == 0 {
            return Ok(());
        }
        let sorted = match self.route_path_for(ws.tokens) {
            RoutePath::Fused => {
                let source = logits.map_or(RouteSource::Router, RouteSource::Logits);
                if self.one_token(ws, source)? {
                    return Ok(());
                }
                self.route_small(ws, source)?;
                false
            }
            RoutePath::Split => {
                self.route_device(ws, logits)?;
                let sorted = self.gemm1_reads_sorted(ws.tokens);
                self.group_device(ws, sorted)?;
                sorted
            }
        };
        self.gemms_device(ws, sorted)
    }
}

/// [`CudaLayer`] behind the host-memory backend trait.
pub(crate) struct CudaExperts {
    layer: CudaLayer,
    ws: Mutex<Option<CudaWorkspace>>,
}

impl CudaExperts {
    pub(crate) fn new(spec: &MoeSpec, w: Arc<MoeWeights>) -> Result<Self> {
        Ok(Self {
            layer: CudaLayer::new(spec, &w)?,
            ws: Mutex::new(None),
        })
    }

    fn with_workspace<T>(
        &self,
        tokens: usize,
        f: impl FnOnce(&CudaLayer, &mut CudaWorkspace) -> Result<T>,
    ) -> Result<T> {
        let mut guard = self.ws.lock().map_err(|_| Error::Cuda {
            stage: "workspace",
            message: "a previous forward panicked while holding the workspace".into(),
        })?;
        if guard.as_ref().map(|w| w.tokens) != Some(tokens) {
            *guard = None;
            *guard = Some(self.layer.workspace(tokens)?);
        }
        match guard.as_mut() {
            Some(ws) => f(&self.layer, ws),
            None => Err(Error::Cuda {
                stage: "workspace",
                message: "workspace allocation failed".into(),
            }),
        }
    }
}

impl Experts for CudaExperts {
    fn workspace_bytes(&self, tokens: usize) -> usize {
        CudaLayer::workspace_bytes(&self.layer.spec, tokens)
    }

    fn forward(&self, x: &[f32], topk: &TopK, out: &mut [f32], _ws: &mut Workspace) -> Result<()> {
        self.with_workspace(topk.tokens, |layer, ws| {
            let st = layer.stream();
            st.memcpy_htod(x, &mut ws.x)
                .map_err(driver_err("input upload"))?;
            st.memcpy_htod(&topk.ids, &mut ws.ids)
                .map_err(driver_err("input upload"))?;
            st.memcpy_htod(&topk.weights, &mut ws.weights)
                .map_err(driver_err("input upload"))?;
            layer.experts_device(ws)?;
            st.memcpy_dtoh(&ws.out, out)
                .map_err(driver_err("output download"))?;
            st.synchronize().map_err(driver_err("synchronize"))
        })
    }

    fn routes_on_device(&self) -> bool {
        true
    }

    fn run_routed(&self, x: &[f32], logits: Option<&[f32]>, out: &mut [f32]) -> Result<TopK> {
        let tokens = x.len() / self.layer.spec.shape.hidden;
        let k = self.layer.spec.routing.top_k;
        self.with_workspace(tokens, |layer, ws| {
            let st = layer.stream();
            st.memcpy_htod(x, &mut ws.x)
                .map_err(driver_err("input upload"))?;
            let dl = match logits {
                Some(l) => Some(st.clone_htod(l).map_err(driver_err("input upload"))?),
                None => None,
            };
            layer.forward_device(ws, dl.as_ref())?;
            let mut topk = TopK {
                tokens,
                k,
                ids: vec![0; tokens * k],
                weights: vec![0.0; tokens * k],
            };
            st.memcpy_dtoh(&ws.out, out)
                .map_err(driver_err("output download"))?;
            st.memcpy_dtoh(&ws.ids, &mut topk.ids)
                .map_err(driver_err("output download"))?;
            st.memcpy_dtoh(&ws.weights, &mut topk.weights)
                .map_err(driver_err("output download"))?;
            st.synchronize().map_err(driver_err("synchronize"))?;
            Ok(topk)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routing_kernels_wait_first() {
        // CudaLayer::launch makes these dependent launches: nothing may run before the wait.
        for file in [
            "routing.cu",
            "sort_pairs.cu",
            "prepare_input.cu",
            "route_small.cu",
        ] {
            let src = compile::kernel_text(file);
            let mut n = 0;
            for (at, _) in src.match_indices("extern \"C\" __global__") {
                let body = &src[at..];
                let open = body.find(") {").expect("kernel body") + 3;
                assert!(
                    body[open..].trim_start().starts_with("pdl_enter();"),
                    "{file}: a kernel does not start with pdl_enter()"
                );
                n += 1;
            }
            assert_eq!(n, compile::kernel_names(file).len(), "{file}");
        }
    }

    #[test]
    fn kernel_args_keep_each_value_whole_in_an_aligned_slot() {
        let params = RouteSmallParams {
            tokens: 7,
            rsf: 2.5,
            ticket: 0xdead_beef_0000_0001,
            ..Default::default()
        };
        let mut a = KernelArgs::default();
        a.arg(&-5i32)
            .arg(&1.25f32)
            .arg(&0x1234_5678_9abc_def0u64)
            .arg(&params);
        let ptrs = a.pointers();
        assert_eq!(ptrs.len(), 4);
        assert!(ptrs.iter().all(|p| *p as usize % 8 == 0));
        // SAFETY: each pointer addresses a live slot holding a value of the type read.
        unsafe {
            assert_eq!(*(ptrs[0] as *const i32), -5);
            assert_eq!(*(ptrs[1] as *const f32), 1.25);
            assert_eq!(*(ptrs[2] as *const u64), 0x1234_5678_9abc_def0);
            let back = *(ptrs[3] as *const RouteSmallParams);
            assert_eq!(
                (back.tokens, back.rsf, back.ticket),
                (7, 2.5, params.ticket)
            );
        }
    }

    #[test]
    fn router_bf16_copy_is_padded_and_only_for_bf16_routers() {
        let (e, h) = (3, 36);
        let router: Vec<f32> = (0..e * h).map(|i| (i as f32 - 50.0) * 0.375).collect();
        let (w, hp) = router_bf16_copy(&router, e, h).unwrap();
        assert_eq!((hp, w.len()), (64, 128 * 64));
        for (i, v) in w.iter().enumerate() {
            let (row, col) = (i / hp, i % hp);
            let want = if row < e && col < h {
                router[row * h + col]
            } else {
                0.0
            };
            assert_eq!(half::bf16::from_bits(*v).to_f32(), want, "({row}, {col})");
        }
        // One f32-only weight, a non-finite one, or H not a multiple of 4: the f32 kernels.
        let mut f32_only = router.clone();
        f32_only[7] = 1.0 + f32::EPSILON;
        assert!(router_bf16_copy(&f32_only, e, h).is_none());
        let mut inf = router.clone();
        inf[0] = f32::INFINITY;
        assert!(router_bf16_copy(&inf, e, h).is_none());
        assert!(router_bf16_copy(&router[..e * 34], e, 34).is_none());
    }

    #[test]
    fn combine_launch_covers_each_column_once() {
        for hidden in [16, 48, 2048, 2064, 2688, 2880, 7168, 7184] {
            let cfg = combine_launch(5, hidden);
            let units = hidden / 8;
            let (blocks, threads) = (cfg.grid_dim.1 as usize, cfg.block_dim.0 as usize);
            assert_eq!(cfg.grid_dim.0, 5);
            assert!(threads % 32 == 0 && threads <= 256, "{hidden}: {threads}");
            assert!(blocks * threads >= units && (blocks - 1) * threads < units);
            assert!(
                blocks * threads - units < 32 * blocks,
                "{hidden}: idle warps"
            );
        }
        assert_eq!(combine_launch(1, 2688).grid_dim.1, 2);
        assert_eq!(combine_launch(1, 2688).block_dim.0, 192);
    }

    #[test]
    fn scale_code_biases_match_the_kernels() {
        let pair = u32::from(pack::SCALE_T_OR) * 0x0001_0001;
        let define = format!("#define SCALE_PAIR_OR {pair:#010x}u\n");
        assert!(
            compile::kernel_text("gemm_common.cuh").contains(&define),
            "{define}"
        );
    }

    #[test]
    fn tuning_choice_maps_known_values_only() {
        static SET: OnceLock<Option<String>> = OnceLock::new();
        static ODD: OnceLock<Option<String>> = OnceLock::new();
        static UNSET: OnceLock<Option<String>> = OnceLock::new();
        // Cells filled up front: the variable names below are never read from the environment.
        SET.get_or_init(|| Some("split".into()));
        ODD.get_or_init(|| Some("Split".into()));
        UNSET.get_or_init(|| None);
        let choices = [("fused", RoutePath::Fused), ("split", RoutePath::Split)];
        assert_eq!(
            tuning_choice(&SET, "FP4MOE_TEST_UNREAD", &choices),
            Some(RoutePath::Split)
        );
        assert_eq!(tuning_choice(&ODD, "FP4MOE_TEST_UNREAD", &choices), None);
        assert_eq!(tuning_choice(&UNSET, "FP4MOE_TEST_UNREAD", &choices), None);
    }

    #[test]
    fn limits_are_checked_before_any_device_work() {
        use crate::{spec::QuantMode, synthetic::Preset};
        let spec = Preset::Nemotron3Nano.spec(QuantMode::W4A16);
        assert!(check_limits(&spec).is_ok());
        let mut many = spec;
        many.shape.experts = MAX_EXPERTS + 1;
        let mut wide = spec;
        wide.routing.top_k = MAX_TOP_K + 1;
        let mut groups = spec;
        groups.routing.n_group = MAX_GROUPS + 1;
        for (bad, what) in [(many, "experts"), (wide, "top_k"), (groups, "n_group")] {
            match check_limits(&bad) {
                Err(Error::Unsupported { reason, .. }) => {
                    assert!(reason.starts_with(what), "{reason}")
                }
                other => panic!("{what}: {other:?}"),
            }
        }
    }

    #[test]
    fn route_small_parameters_match_the_kernel() {
        for (name, mode) in [
            ("ROUTE_FROM_ROUTER", ROUTE_FROM_ROUTER),
            ("ROUTE_FROM_LOGITS", ROUTE_FROM_LOGITS),
            ("ROUTE_FROM_IDS", ROUTE_FROM_IDS),
        ] {
            assert_eq!(
                compile::kernel_define("route_small.cu", name),
                mode as usize,
                "{name}"
            );
        }
        // 13 pointers, 10 ints, 2 floats, no padding (the kernel's struct).
        assert_eq!(std::mem::size_of::<RouteSmallParams>(), 13 * 8 + 12 * 4);
    }

    /// `GemmParams` mirrors gemm_common.cuh's struct: the same scalar fields in the same order
    /// after the 12 pointers, and no padding.
    #[test]
    fn gemm_parameters_match_the_kernel() {
        assert_eq!(std::mem::size_of::<GemmParams>(), 12 * 8 + 14 * 4);
        let body = compile::kernel_text("gemm_common.cuh")
            .split("struct GemmParams {")
            .nth(1)
            .and_then(|b| b.split("};").next())
            .unwrap_or_default();
        let scalars: Vec<&str> = body
            .lines()
            .filter_map(|l| {
                l.trim()
                    .strip_prefix("int ")
                    .or(l.trim().strip_prefix("float "))
            })
            .filter_map(|l| l.split(';').next())
            .collect();
        let want = [
            "rg_out",
            "rg_w",
            "kg",
            "k",
            "shards",
            "top_k",
            "activation",
            "out_stride",
            "act_alpha",
            "gs_out",
            "tile_rows",
            "experts",
            "wait_blocks",
            "wait_nt",
        ];
        assert_eq!(scalars, want);
        assert_eq!(body.matches('*').count(), 12);
        // find_tile sizes its per-thread expert slices for the host's limit.
        assert_eq!(
            compile::kernel_define("prefill_gemm.cu", "PF_MAX_EXPERTS"),
            MAX_EXPERTS
        );
    }

    #[test]
    fn prefill_feed_needs_sm90a_one_box_and_16_byte_rows() {
        use PrefillFeed::*;
        let (l, sm, w) = (PrefillTile::Large, PrefillTile::Small, PrefillTile::Wide);
        // 4096 operand rows, 24 tokens per expert; `tiles` weight-row tiles.
        let choose = |tile, k, tiles, arch, forced| {
            PrefillFeed::choose(tile, 24, k, 4096, tiles, arch, forced)
        };
        assert_eq!(choose(l, 2688, 8, "sm_90a", None), Tma);
        assert_eq!(
            choose(l, 2688, 8, "sm_90a", Some(TmaMulticast)),
            TmaMulticast
        );
        // An odd count of row tiles cannot pair up.
        assert_eq!(choose(l, 1856, 11, "sm_90a", Some(TmaMulticast)), Tma);
        assert_eq!(choose(l, 2688, 8, "sm_90a", Some(CpAsync)), CpAsync);
        // Wide tiles: TMA, never multicast.
        assert_eq!(choose(w, 2688, 8, "sm_90a", None), Tma);
        assert_eq!(choose(w, 2688, 8, "sm_90a", Some(TmaMulticast)), Tma);
        assert_eq!(choose(w, 2688, 8, "sm_80", None), CpAsync);
        let d = PrefillTile::Dual;
        assert_eq!(choose(d, 2688, 8, "sm_90a", Some(TmaMulticast)), Tma);
        assert_eq!(choose(d, 2688, 8, "sm_80", None), CpAsync);
        // 32-token tiles: TMA (32-row boxes) from 32 operand rows, never multicast.
        assert_eq!(choose(sm, 2688, 8, "sm_90a", None), Tma);
        assert_eq!(choose(sm, 2688, 8, "sm_90a", Some(TmaMulticast)), Tma);
        assert_eq!(choose(sm, 2688, 8, "sm_80", None), CpAsync);
        assert_eq!(choose(sm, 2688, 8, "sm_90a", Some(CpAsync)), CpAsync);
        assert_eq!(
            PrefillFeed::choose(sm, 24, 2688, 32, 8, "sm_90a", None),
            Tma
        );
        assert_eq!(
            PrefillFeed::choose(sm, 24, 2688, 31, 8, "sm_90a", None),
            CpAsync
        );
        // Below PREFILL_SMALL_TMA_FROM tokens per expert they keep cp.async unless TMA is
        // forced (the sorted copy of the input costs more there); the other tiles take TMA.
        let few = PREFILL_SMALL_TMA_FROM - 1;
        assert_eq!(
            PrefillFeed::choose(sm, few, 2688, 4096, 8, "sm_90a", None),
            CpAsync
        );
        let forced = PrefillFeed::choose(sm, few, 2688, 4096, 8, "sm_90a", Some(Tma));
        assert_eq!(forced, Tma);
        let from = PREFILL_SMALL_TMA_FROM;
        assert_eq!(
            PrefillFeed::choose(sm, from, 2688, 4096, 8, "sm_90a", None),
            Tma
        );
        assert_eq!(
            PrefillFeed::choose(l, few, 2688, 4096, 8, "sm_90a", None),
            Tma
        );
        assert_eq!(
            PrefillFeed::choose(w, few, 2688, 4096, 8, "sm_90a", None),
            Tma
        );
        // Not applicable: cp.async whatever was asked for.
        assert_eq!(choose(l, 2688, 8, "sm_90", Some(Tma)), CpAsync);
        assert_eq!(choose(l, 2688, 8, "sm_80", None), CpAsync);
        assert_eq!(choose(l, 2692, 8, "sm_90a", None), CpAsync);
        // K shorter than one 64-wide box, or fewer operand rows than one box holds.
        assert_eq!(choose(l, 48, 1, "sm_90a", None), CpAsync);
        let few_rows = PrefillFeed::choose(l, 24, 2688, 63, 8, "sm_90a", None);
        assert_eq!(few_rows, CpAsync);
        assert_eq!(TmaMulticast.cluster(), 2);
        assert_eq!(Tma.cluster(), 1);
        for (tile, feed) in [(l, Tma), (l, TmaMulticast), (w, Tma), (d, Tma), (sm, Tma)] {
            for gemm in [
                PrefillGemm::Gemm1Gated,
                PrefillGemm::Gemm1Plain,
                PrefillGemm::Gemm2,
            ] {
                let name = gemm.kernel(tile, feed).unwrap();
                assert_eq!(name.contains("tma2"), feed == TmaMulticast, "{name}");
                assert_eq!(name.contains("wide"), tile == w, "{name}");
                assert_eq!(name.contains("dual"), tile == d, "{name}");
                assert_eq!(name.contains("small"), tile == sm, "{name}");
            }
        }
    }
}
