//! The CUDA backend: NVRTC-compiled kernels (`crates/fp4moe/kernels/*.cu`), weights prepared
//! once into the decode kernels' fragment layout ([`pack`]), and a device pipeline with no host
//! synchronization, so a caller can capture [`CudaLayer::forward_device`] in a CUDA graph:
//!
//! ```text
//! router_logits? → route_topk → sort_pairs → prepare_input(_sorted) → gemm1 (+act, W4A4 QDQ) → gemm2
//!               (shared expert: gemm1 → gemm2) → combine → y [T, H]
//! ```
//! Small batches ([`RoutePath`]) run the first four stages as one launch, `route_small`, on the
//! same device code (bitwise the same results); one token (no shared expert) runs the whole
//! layer as one launch (`one_token.cu`, bitwise the same results again). The shared expert's grouping (every token once,
//! weight 1) is written once per workspace. No float atomics anywhere: results are bitwise
//! reproducible from run to run. Between the GEMMs the intermediate is bf16 (DESIGN 2's "bf16
//! intermediates"), and so is each pair's weighted GEMM2 output, which the combine sums in f32
//! in slot order (as vLLM's, SGLang's and TensorRT-LLM's fused MoE store them).
//!
//! Every `unsafe` block of the crate lives under this module, each with a `// SAFETY:` line.
//! A machine without a driver never reaches cudarc's loaders: [`device`] checks
//! `is_culib_present()` first and reports [`Error::CudaUnavailable`].

mod bare_read;
pub mod bench;
mod compile;
mod gemm_launch;
mod gemm_plan;
mod one_token;
pub mod pack;
mod route_launch;
mod route_plan;

pub use bare_read::BareRead;
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
    /// The experts with at least one pair, by decreasing ⌈pairs / 8⌉ (8-token passes, equal from
    /// 31 on), ties in increasing id: the decode GEMMs' slot order (`sort_pairs.cuh`'s
    /// `slot_key`).
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
    /// Forced token tile of the bf16 router (16 or 64; [`CudaLayer::set_router_bf16_tile`]).
    router_bf16_tile: Option<usize>,
    stream_units: Option<usize>,
    /// Forced on or off: the one-token layer in one launch ([`CudaLayer::set_one_token`]).
    one_token: Option<bool>,
    /// The one-token kernel's launch shape per pair of K splits (GEMM1's, GEMM2's units per
    /// virtual block), `None` where it does not fit.
    one_token_shapes: Mutex<Vec<one_token::CachedShape>>,
    /// Forwards stop after this many of [`STAGES`] (timing diagnostics).
    stage_limit: Option<usize>,
    /// Forwards run this yardstick instead of the layer ([`CudaLayer::set_bare_read`], a
    /// timing diagnostic; it takes precedence over `stage_limit`).
    bare_read: Option<BareRead>,
    /// The yardstick's per-block read counts and its XOR-match word, allocated once.
    bare_read_sink: Option<CudaSlice<u32>>,
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
            router_bf16_tile: None,
            stream_units: None,
            one_token: None,
            one_token_shapes: Mutex::new(Vec::new()),
            stage_limit: None,
            bare_read: None,
            bare_read_sink: None,
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
    /// else the default rule). A shape without a kernel for the launch's token subtiles or
    /// weights (the half shape on bf16 weights) falls back to the wide one.
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
    /// values, [`RouterKernel::Wide`] otherwise). The threshold follows the kernel:
    /// [`ROUTER_BF16_FROM`] tokens for the bf16 one, [`ROUTER_TILED_FROM`] for the others.
    pub fn set_router_kernel(&mut self, kernel: Option<RouterKernel>) {
        self.router_kernel = kernel;
    }

    /// Forces the bf16 router's token tile (16 or 64 tokens; `None`: `FP4MOE_ROUTER_BF16_TILE`,
    /// else [`router_bf16_tile`]'s rule). Both tiles give the same bits.
    pub fn set_router_bf16_tile(&mut self, tile: Option<usize>) {
        self.router_bf16_tile = tile;
    }

    /// The bf16 router's token tile for `tokens` tokens.
    fn router_bf16_tile(&self, tokens: usize) -> usize {
        static KNOB: OnceLock<Option<String>> = OnceLock::new();
        let env = || tuning_choice(&KNOB, "FP4MOE_ROUTER_BF16_TILE", &[("16", 16), ("64", 64)]);
        router_bf16_tile(tokens, self.router_bf16_tile.or_else(env))
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
    /// from the bf16 router kernel's [`ROUTER_BF16_FROM`] tokens, as `workspace` allocates for a layer with a
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
        if let Some(mode) = self.bare_read {
            return self.bare_read_device(ws, logits, mode);
        }
        let path = self.route_path_for(ws.tokens);
        let source = logits.map_or(RouteSource::Router, RouteSource::Logits);
        if path == RoutePath::Fused && self.one_token(ws, source)? {
            return Ok(());
        }
        let sorted = self.route_and_group(ws, logits, path)?;
        self.gemms_device(ws, sorted)
    }

    /// Routing, pair grouping and input preparation on `path` (`route_small`'s one launch, or
    /// the split kernels), never the one-token layer; returns whether GEMM1 reads the sorted
    /// operand (`ws.a_sorted`).
    fn route_and_group(
        &self,
        ws: &mut CudaWorkspace,
        logits: Option<&CudaSlice<f32>>,
        path: RoutePath,
    ) -> Result<bool> {
        match path {
            RoutePath::Fused => {
                self.route_small(ws, logits.map_or(RouteSource::Router, RouteSource::Logits))?;
                Ok(false)
            }
            RoutePath::Split => {
                self.route_device(ws, logits)?;
                let sorted = self.gemm1_reads_sorted(ws.tokens);
                self.group_device(ws, sorted)?;
                Ok(sorted)
            }
        }
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
        // CudaLayer::launch makes these dependent launches: nothing may run before the wait,
        // except in prepare_input, whose inputs and outputs are settled before it can launch
        // (prepare_input.cu says why): it waits at exit in block 0, so its grid still
        // completes after its predecessor's; and route_topk's prefetch of the bias (a weight
        // no kernel writes; a prefetch changes no memory), its comment and one statement.
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
                let name = body[..body.find('(').expect("kernel name")]
                    .split_whitespace()
                    .last()
                    .expect("kernel name");
                let open = body.find(") {").expect("kernel body") + 3;
                let end = body.find("\n}").expect("kernel end");
                let mut code = body[open..end].trim_start();
                if name == "route_topk" {
                    while code.starts_with("//") {
                        code = code[code.find('\n').expect("comment line") + 1..].trim_start();
                    }
                    let prefetch = "if (TOPK_BIAS_PREFETCH && bias && threadIdx.x < 32 && threadIdx.x * 32 < experts)\n        asm volatile(\"prefetch.global.L1 [%0];\" ::\"l\"(bias + threadIdx.x * 32));";
                    assert!(
                        code.starts_with(prefetch),
                        "{file}: route_topk may only prefetch the bias before its wait"
                    );
                    code = code[prefetch.len()..].trim_start();
                }
                if name == "prepare_input" {
                    assert!(
                        code.starts_with("pdl_launch_dependents();")
                            && code
                                .trim_end()
                                .ends_with("if (blockIdx.x == 0 && threadIdx.x == 0) pdl_wait();"),
                        "{file}: prepare_input must wait at its end"
                    );
                } else {
                    assert!(
                        code.starts_with("pdl_enter();"),
                        "{file}: {name} does not start with pdl_enter()"
                    );
                }
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
