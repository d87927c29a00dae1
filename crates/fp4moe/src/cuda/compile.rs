//! Kernel compilation: embedded `.cu` sources → NVRTC → CUBIN for one architecture, cached on
//! disk (`FP4MOE_CACHE_DIR`, default `$XDG_CACHE_HOME/fp4moe` or `~/.cache/fp4moe`) under a key
//! of source, headers, options, NVRTC version and architecture. cudarc's safe NVRTC API returns
//! PTX only, so CUBIN comes from the raw `nvrtcGetCUBIN`.
//!
//! CUDA headers (`cuda_bf16.h`, `cuda_fp8.h`) are found in `FP4MOE_CUDA_INCLUDE`, `CUDA_HOME` /
//! `CUDA_PATH` `/include`, `/usr/local/cuda/include`, then a pip `nvidia/cu13/include` next to a
//! `nvidia/cu13/lib` on `LD_LIBRARY_PATH`.

use cudarc::nvrtc::sys;
use std::ffi::{CStr, CString};
use std::hash::{Hash, Hasher};
use std::path::PathBuf;

/// The shared headers kernel files include: conversions and MMA wrappers, the expert-GEMM
/// parameters, dequantization and epilogues both GEMM paths use, the routing, pair-sort and
/// input-preparation code the split kernels, `route_small` and `one_token` use, and the
/// streaming GEMMs' per-warp steps (`expert_stream.cu`, `one_token.cu`).
pub const HEADERS: [(&str, &str); 6] = [
    ("common.cuh", include_str!("../../kernels/common.cuh")),
    (
        "gemm_common.cuh",
        include_str!("../../kernels/gemm_common.cuh"),
    ),
    ("routing.cuh", include_str!("../../kernels/routing.cuh")),
    (
        "sort_pairs.cuh",
        include_str!("../../kernels/sort_pairs.cuh"),
    ),
    (
        "prepare_input.cuh",
        include_str!("../../kernels/prepare_input.cuh"),
    ),
    (
        "expert_stream.cuh",
        include_str!("../../kernels/expert_stream.cuh"),
    ),
];

/// Kernel files, one pipeline stage each; `route_small.cu` fuses the first four stages for small
/// batches, `one_token.cu` the whole layer for one token; `bare_read.cu` is a timing yardstick
/// (`fp4moe bench --bare-reads`), not part of the layer.
pub const SOURCES: [(&str, &str); 10] = [
    ("routing.cu", include_str!("../../kernels/routing.cu")),
    ("sort_pairs.cu", include_str!("../../kernels/sort_pairs.cu")),
    (
        "prepare_input.cu",
        include_str!("../../kernels/prepare_input.cu"),
    ),
    (
        "expert_gemm.cu",
        include_str!("../../kernels/expert_gemm.cu"),
    ),
    (
        "expert_stream.cu",
        include_str!("../../kernels/expert_stream.cu"),
    ),
    (
        "prefill_gemm.cu",
        include_str!("../../kernels/prefill_gemm.cu"),
    ),
    ("combine.cu", include_str!("../../kernels/combine.cu")),
    (
        "route_small.cu",
        include_str!("../../kernels/route_small.cu"),
    ),
    ("one_token.cu", include_str!("../../kernels/one_token.cu")),
    ("bare_read.cu", include_str!("../../kernels/bare_read.cu")),
];

/// The text of kernel source or header `file` (tests tie host constants and structs to the
/// kernels' own). Panics when there is no such file.
#[cfg(test)]
pub(super) fn kernel_text(file: &str) -> &'static str {
    SOURCES
        .iter()
        .chain(HEADERS.iter())
        .find(|(f, _)| *f == file)
        .map(|(_, s)| *s)
        .unwrap_or_else(|| panic!("{file} is not a kernel source or header"))
}

/// The value of `#define NAME value` in kernel source or header `file`. Panics when the file or
/// the define is missing.
#[cfg(test)]
pub(super) fn kernel_define(file: &str, name: &str) -> usize {
    let line = kernel_text(file)
        .lines()
        .find(|l| l.starts_with(&format!("#define {name} ")))
        .unwrap_or_else(|| panic!("{name} not defined in {file}"));
    line.split_whitespace()
        .nth(2)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("{name} in {file} is not a number"))
}

/// The `extern "C"` kernels each file defines (`expert_gemm.cu` instantiates every weight kind,
/// stage, block shape and token-tile count).
pub fn kernel_names(file: &str) -> Vec<String> {
    let fixed: &[&str] = match file {
        "routing.cu" => &[
            "router_logits",
            "router_logits_multi",
            "router_logits_tiled",
            "router_logits_tf32x3",
            "router_logits_wide",
            "router_logits_bf16",
            "router_logits_bf16_t16",
            "router_sum_splits",
            "route_topk",
        ],
        "sort_pairs.cu" => &[
            "sort_pairs",
            "count_pairs",
            "scan_pair_counts",
            "place_pairs",
        ],
        "prepare_input.cu" => &[
            "prepare_input",
            "prepare_input_sorted",
            "invert_pairs",
            "gather_rows",
        ],
        "route_small.cu" => &["route_small"],
        "one_token.cu" => &["one_token_plain", "one_token_gated"],
        "combine.cu" => &["combine"],
        "bare_read.cu" => &["bare_read"],
        "prefill_gemm.cu" => &[
            "prefill_gemm1_gated",
            "prefill_gemm1_plain",
            "prefill_gemm2",
            "prefill_small_gemm1_gated",
            "prefill_small_gemm1_plain",
            "prefill_small_gemm2",
            "prefill_small_tma_gemm1_gated",
            "prefill_small_tma_gemm1_plain",
            "prefill_small_tma_gemm2",
            "prefill_tma1_gemm1_gated",
            "prefill_tma1_gemm1_plain",
            "prefill_tma1_gemm2",
            "prefill_tma2_gemm1_gated",
            "prefill_tma2_gemm1_plain",
            "prefill_tma2_gemm2",
            "prefill_wide_gemm1_gated",
            "prefill_wide_gemm1_plain",
            "prefill_wide_gemm2",
            "prefill_dual_gemm1_gated",
            "prefill_dual_gemm1_plain",
            "prefill_dual_gemm2",
        ],
        _ => &[],
    };
    let mut names: Vec<String> = fixed.iter().map(|s| s.to_string()).collect();
    if file == "expert_gemm.cu" {
        for base in [
            "gemm1_nvfp4_gated",
            "gemm1_nvfp4_plain",
            "gemm2_nvfp4",
            "gemm1_bf16_gated",
            "gemm1_bf16_plain",
            "gemm2_bf16",
        ] {
            for shape in ["narrow", "wide"] {
                for nsub in [1, 2, 4] {
                    names.push(format!("{base}_{shape}_n{nsub}"));
                }
            }
            names.push(format!("{base}_deep_n1"));
            // The half shape exists for NVFP4 weights only, at four blocks per SM for the
            // gated GEMM1 only (the other half kernels run four already).
            if base.contains("nvfp4") {
                names.push(format!("{base}_half_n1"));
            }
            if base == "gemm1_nvfp4_gated" {
                names.push(format!("{base}_half4_n1"));
            }
        }
    }
    if file == "expert_stream.cu" {
        for base in ["stream_gemm1_gated", "stream_gemm1_plain", "stream_gemm2"] {
            for rb in [1, 2, 4] {
                names.push(format!("{base}_r{rb}"));
            }
        }
    }
    names
}

/// A failed compilation with everything needed to reproduce it.
#[derive(Debug, Clone, thiserror::Error)]
#[error("NVRTC could not compile {file} for {arch} (options {options:?}):\n{log}")]
pub struct CompileError {
    pub file: String,
    pub arch: String,
    pub options: Vec<String>,
    pub log: String,
}

/// A compiled kernel file.
#[derive(Debug, Clone)]
pub struct Compiled {
    pub file: String,
    pub cubin: Vec<u8>,
    /// NVRTC's log, with the ptxas report (registers, shared memory, spills) of every kernel.
    pub log: String,
    pub from_cache: bool,
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("FP4MOE_CACHE_DIR") {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(d).join("fp4moe"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("fp4moe"))
}

/// The include directory holding `cuda_bf16.h`, searched in the documented order.
pub fn include_dir() -> Option<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(d) = std::env::var_os("FP4MOE_CUDA_INCLUDE") {
        candidates.push(PathBuf::from(d));
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(d) = std::env::var_os(var) {
            candidates.push(PathBuf::from(d).join("include"));
        }
    }
    candidates.push(PathBuf::from("/usr/local/cuda/include"));
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        for p in std::env::split_paths(&paths) {
            if p.ends_with("nvidia/cu13/lib") {
                if let Some(parent) = p.parent() {
                    candidates.push(parent.join("include"));
                }
            }
        }
    }
    candidates
        .into_iter()
        .find(|d| d.join("cuda_bf16.h").is_file())
}

/// NVRTC's version as (major, minor).
pub fn nvrtc_version() -> Result<(i32, i32), String> {
    // SAFETY: only checks whether the shared library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err("libnvrtc was not found (install the CUDA toolkit or the nvidia-cuda-nvrtc wheel and add its lib folder to LD_LIBRARY_PATH)".into());
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is present; the pointers are valid for the call.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    if r != sys::nvrtcResult::NVRTC_SUCCESS {
        return Err(format!("nvrtcVersion failed: {r:?}"));
    }
    Ok((major, minor))
}

/// Extra kernel `#define`s for experiments, from `FP4MOE_DEFINES` (`NAME=VALUE` or `NAME`,
/// separated by `+`, `,` or `;`): one binary times kernel variants (gpu-ab.sh's `BIN@FP4MOE_DEFINES=…`).
/// They enter the cache key of every file they may change ([`key_options`]).
fn extra_defines() -> Vec<String> {
    let Some(defs) = std::env::var("FP4MOE_DEFINES")
        .ok()
        .filter(|d| !d.trim().is_empty())
    else {
        return Vec::new();
    };
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED
        .call_once(|| eprintln!("FP4MOE_DEFINES={defs}: kernels built with experimental defines"));
    defs.split(['+', ',', ';'])
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| format!("-D{d}"))
        .collect()
}

/// The options that enter a file's cache key: all but the `-D` defines that name a knob of
/// another kernel file only (a name some kernel source spells, but neither this file nor the
/// kernel headers), so the variants of one `FP4MOE_DEFINES` experiment share the CUBINs of every
/// file they do not touch. A name no kernel source spells stays in every key: it may steer the
/// CUDA headers (`CUDA_NO_BFLOAT16`) or another define's value.
fn key_options<'a>(source: &str, opts: &'a [String]) -> Vec<&'a str> {
    let kept = |name: &str| {
        source.contains(name)
            || HEADERS.iter().any(|(_, text)| text.contains(name))
            || !SOURCES.iter().any(|(_, text)| text.contains(name))
    };
    opts.iter()
        .map(String::as_str)
        .filter(|o| match o.strip_prefix("-D") {
            // `NAME`, `NAME=VALUE` or a function-like `NAME(ARGS)=VALUE`.
            Some(def) => kept(def.split(['=', '(']).next().unwrap_or(def)),
            None => true,
        })
        .collect()
}

fn options(arch: &str, include: &std::path::Path) -> Vec<String> {
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".into(),
        "-lineinfo".into(),
        "--ptxas-options=-v".into(),
    ];
    opts.extend(extra_defines());
    // Last: the cache key leaves the include path out (the same kernels on every machine).
    opts.push(format!("--include-path={}", include.display()));
    opts
}

/// Compiles one kernel file for `arch` (e.g. `sm_90a`, `sm_80`), using the disk cache.
pub fn compile(file: &str, source: &str, arch: &str) -> Result<Compiled, CompileError> {
    let fail = |log: String, options: &[String]| CompileError {
        file: file.to_string(),
        arch: arch.to_string(),
        options: options.to_vec(),
        log,
    };
    let version = nvrtc_version().map_err(|e| fail(e, &[]))?;
    let include = include_dir().ok_or_else(|| {
        fail(
            "cuda_bf16.h not found: set FP4MOE_CUDA_INCLUDE or CUDA_HOME, or install the CUDA toolkit in /usr/local/cuda".into(),
            &[],
        )
    })?;
    let opts = options(arch, &include);
    let mut h = std::collections::hash_map::DefaultHasher::new();
    (
        source,
        HEADERS,
        key_options(source, &opts[..opts.len() - 1]),
        version,
        arch,
        env!("CARGO_PKG_VERSION"),
    )
        .hash(&mut h);
    let key = format!(
        "{}-{arch}-{:016x}",
        file.trim_end_matches(".cu"),
        h.finish()
    );
    let cached =
        cache_dir().map(|d| (d.join(format!("{key}.cubin")), d.join(format!("{key}.log"))));
    if let Some((cubin_path, log_path)) = &cached {
        if let (Ok(cubin), Ok(log)) = (std::fs::read(cubin_path), std::fs::read_to_string(log_path))
        {
            // An empty CUBIN is a broken entry (an interrupted writer): compile again.
            if !cubin.is_empty() {
                return Ok(Compiled {
                    file: file.to_string(),
                    cubin,
                    log,
                    from_cache: true,
                });
            }
        }
    }
    let (cubin, log) = nvrtc_cubin(file, source, &opts).map_err(|log| fail(log, &opts))?;
    if let Some((cubin_path, log_path)) = &cached {
        // A cache that cannot be written only costs a recompilation next time.
        if let Some(dir) = cubin_path.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let _ = crate::tensor_io::write_atomic(cubin_path, &cubin);
        let _ = crate::tensor_io::write_atomic(log_path, log.as_bytes());
    }
    Ok(Compiled {
        file: file.to_string(),
        cubin,
        log,
        from_cache: false,
    })
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<(), String> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} failed: {r:?}"))
    }
}

/// The raw NVRTC sequence: create, compile, log, CUBIN, destroy.
fn nvrtc_cubin(file: &str, source: &str, opts: &[String]) -> Result<(Vec<u8>, String), String> {
    let src = CString::new(source).map_err(|e| e.to_string())?;
    let name = CString::new(file).map_err(|e| e.to_string())?;
    let hdr_src: Vec<CString> = HEADERS
        .iter()
        .map(|(_, text)| CString::new(*text))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let hdr_name: Vec<CString> = HEADERS
        .iter()
        .map(|(name, _)| CString::new(*name))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let headers: Vec<*const std::ffi::c_char> = hdr_src.iter().map(|c| c.as_ptr()).collect();
    let include_names: Vec<*const std::ffi::c_char> = hdr_name.iter().map(|c| c.as_ptr()).collect();
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()))
        .collect::<Result<_, _>>()
        .map_err(|e| e.to_string())?;
    let opt_ptrs: Vec<*const std::ffi::c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: every pointer refers to a NUL-terminated string that outlives the call; the header
    // arrays both hold `HEADERS.len()` entries.
    check(
        unsafe {
            sys::nvrtcCreateProgram(
                &mut prog,
                src.as_ptr(),
                name.as_ptr(),
                headers.len() as i32,
                headers.as_ptr(),
                include_names.as_ptr(),
            )
        },
        "nvrtcCreateProgram",
    )?;
    // SAFETY: `prog` was created above; the option pointers live until the call returns.
    let compiled =
        unsafe { sys::nvrtcCompileProgram(prog, opt_ptrs.len() as i32, opt_ptrs.as_ptr()) };
    let mut log_len = 0usize;
    // SAFETY: `prog` is valid; the out-pointer is valid.
    let mut log = String::new();
    if unsafe { sys::nvrtcGetProgramLogSize(prog, &mut log_len) } == sys::nvrtcResult::NVRTC_SUCCESS
        && log_len > 1
    {
        let mut buf = vec![0u8; log_len];
        // SAFETY: `buf` holds the `log_len` bytes NVRTC asked for.
        if unsafe { sys::nvrtcGetProgramLog(prog, buf.as_mut_ptr() as *mut std::ffi::c_char) }
            == sys::nvrtcResult::NVRTC_SUCCESS
        {
            log = CStr::from_bytes_until_nul(&buf)
                .map(|c| c.to_string_lossy().into_owned())
                .unwrap_or_default();
        }
    }
    let result = check(compiled, "nvrtcCompileProgram")
        .map_err(|e| format!("{e}\n{log}"))
        .and_then(|()| {
            let mut size = 0usize;
            // SAFETY: `prog` compiled successfully; the out-pointer is valid.
            check(
                unsafe { sys::nvrtcGetCUBINSize(prog, &mut size) },
                "nvrtcGetCUBINSize",
            )?;
            let mut cubin = vec![0u8; size];
            // SAFETY: `cubin` holds the `size` bytes NVRTC reported.
            check(
                unsafe { sys::nvrtcGetCUBIN(prog, cubin.as_mut_ptr() as *mut std::ffi::c_char) },
                "nvrtcGetCUBIN",
            )?;
            Ok(cubin)
        });
    // SAFETY: `prog` is valid and destroyed exactly once.
    unsafe { sys::nvrtcDestroyProgram(&mut prog) };
    result.map(|cubin| (cubin, log))
}

/// Resource usage of one kernel from a ptxas report.
#[derive(Debug, Clone, PartialEq)]
pub struct KernelUsage {
    pub kernel: String,
    pub registers: u32,
    pub shared_bytes: u32,
    pub spill_stores: u32,
    pub spill_loads: u32,
    pub stack_bytes: u32,
}

fn number_before(text: &str, unit: &str) -> Option<u32> {
    let i = text.find(unit)?;
    text[..i].split_whitespace().last()?.parse().ok()
}

/// Parses the `ptxas info` lines of an NVRTC log.
pub fn parse_ptxas(log: &str) -> Vec<KernelUsage> {
    let mut out: Vec<KernelUsage> = Vec::new();
    for line in log.lines() {
        if let Some(i) = line.find("Compiling entry function '") {
            let rest = &line[i + 26..];
            let name = rest.split('\'').next().unwrap_or("").to_string();
            out.push(KernelUsage {
                kernel: name,
                registers: 0,
                shared_bytes: 0,
                spill_stores: 0,
                spill_loads: 0,
                stack_bytes: 0,
            });
        } else if let Some(k) = out.last_mut() {
            if line.contains("bytes stack frame") {
                k.stack_bytes = number_before(line, "bytes stack frame").unwrap_or(0);
                k.spill_stores = number_before(line, "bytes spill stores").unwrap_or(0);
                k.spill_loads = number_before(line, "bytes spill loads").unwrap_or(0);
            } else if line.contains("Used") && line.contains("registers") {
                k.registers = number_before(line, "registers").unwrap_or(0);
                k.shared_bytes = number_before(line, "bytes smem").unwrap_or(0);
            }
        }
    }
    out
}

/// Kernels whose wgmma pipeline ptxas serialized (its C7520 advisory: a wgmma under divergent
/// control flow or registers it could not prove untouched), which costs most of the tensor-core
/// rate; `compile-kernels` fails on them like on spills.
pub fn serialized_wgmma(log: &str) -> Vec<String> {
    log.lines()
        .filter(|l| l.contains("wgmma.mma_async instructions are serialized"))
        .map(|l| {
            l.split("function '")
                .nth(1)
                .and_then(|rest| rest.split('\'').next())
                .unwrap_or(l.trim())
                .to_string()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kernel_list_matches_the_sources() {
        // Every listed kernel is defined (or instantiated) in its file, and every
        // `extern "C" __global__` of the small files is listed.
        for (file, src) in SOURCES {
            let names = kernel_names(file);
            assert!(!names.is_empty(), "{file}");
            for n in &names {
                let base = ["_narrow", "_wide", "_deep", "_half", "_r"]
                    .iter()
                    .fold(n.as_str(), |b, cut| b.split(cut).next().unwrap_or(b));
                assert!(src.contains(base), "{file} lacks {n}");
            }
            if file == "prefill_gemm.cu" {
                let n = [
                    "\nPREFILL(",
                    "\nPREFILL_TMA(",
                    "\nPREFILL_SLOTS8(",
                    "\nPREFILL_SMALL_TMA(",
                ]
                .iter()
                .map(|m| src.matches(m).count())
                .sum::<usize>();
                assert_eq!(n, names.len(), "{file}");
            } else if file == "expert_stream.cu" {
                let n = src.matches("\nSTREAM(").count();
                assert_eq!(3 * n, names.len(), "{file}");
            } else if file == "expert_gemm.cu" {
                // Seven shapes per INSTANTIATE, one per INSTANTIATE_ONE or INSTANTIATE_BLOCKS
                // line; each listed one-off names its line.
                let n = 7 * src.matches("\nINSTANTIATE(").count()
                    + src.matches("\nINSTANTIATE_ONE(").count()
                    + src.matches("\nINSTANTIATE_BLOCKS(").count();
                assert_eq!(n, names.len(), "{file}");
                for (suffix, head, tail) in [
                    ("_half_n1", "INSTANTIATE_ONE", "half)"),
                    (
                        "_half4_n1",
                        "INSTANTIATE_BLOCKS",
                        "half4, GATED_HALF4_BLOCKS)",
                    ),
                ] {
                    for n in names.iter().filter(|n| n.ends_with(suffix)) {
                        let base = n.trim_end_matches(suffix);
                        let line = format!("\n{head}({base}, ");
                        let at = src
                            .find(&line)
                            .unwrap_or_else(|| panic!("{file} lacks {n}"));
                        let end = src[at + 1..].find('\n').map_or(src.len(), |e| at + 1 + e);
                        assert!(src[at..end].ends_with(tail), "{file}: {n}");
                    }
                }
            } else {
                assert_eq!(
                    src.matches("extern \"C\" __global__").count(),
                    names.len(),
                    "{file}"
                );
            }
        }
        assert_eq!(kernel_names("expert_gemm.cu").len(), 46);
    }

    #[test]
    fn cache_keys_keep_only_the_defines_a_file_names() {
        let opts: Vec<String> = [
            "--gpu-architecture=sm_90a",
            "-DDECODE_DEEP_DEPTH=4",
            "-DPF_EARLY_WEIGHTS=0",
            "-DACTIVE_BY_COUNT(x)=x",
            "-DCUDA_NO_BFLOAT16",
            "-DNVFP4_DEQ_UNSCALE",
        ]
        .map(String::from)
        .to_vec();
        let (gemm, combine) = (kernel_text("expert_gemm.cu"), kernel_text("combine.cu"));
        // Only expert_gemm.cu names DECODE_DEEP_DEPTH, only prefill_gemm.cu PF_EARLY_WEIGHTS;
        // ACTIVE_BY_COUNT (function-like here) is a macro of a header, as NVFP4_DEQ_UNSCALE
        // (gemm_common.cuh); no kernel file names CUDA_NO_BFLOAT16 (the CUDA headers do).
        let every = [
            "--gpu-architecture=sm_90a",
            "-DACTIVE_BY_COUNT(x)=x",
            "-DCUDA_NO_BFLOAT16",
            "-DNVFP4_DEQ_UNSCALE",
        ];
        assert_eq!(
            key_options(gemm, &opts),
            [&every[..1], &["-DDECODE_DEEP_DEPTH=4"], &every[1..]].concat()
        );
        assert_eq!(key_options(combine, &opts), every);
        let prefill = key_options(kernel_text("prefill_gemm.cu"), &opts);
        assert!(prefill.contains(&"-DPF_EARLY_WEIGHTS=0"), "{prefill:?}");
        assert!(!prefill.contains(&"-DDECODE_DEEP_DEPTH=4"), "{prefill:?}");
    }

    #[test]
    fn serialized_wgmma_advisories_are_found() {
        let log = "ptxas info    : (C7520) Potential Performance Loss: wgmma.mma_async instructions are serialized due to program dependence on compiler-inserted WG.AR in divergent path in the function 'prefill_gemm2'\n\
                   ptxas info    : Used 190 registers\n";
        assert_eq!(serialized_wgmma(log), vec!["prefill_gemm2".to_string()]);
        assert!(serialized_wgmma("ptxas info    : Used 190 registers\n").is_empty());
        let log = "ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to insufficient register resources for the function 'prefill_small_gemm2'\n";
        assert_eq!(
            serialized_wgmma(log),
            vec!["prefill_small_gemm2".to_string()]
        );
    }

    #[test]
    fn prefill_shared_memory_matches_the_kernel() {
        // PREFILL_SMEM (host) from the kernel's own constants.
        use super::super::PrefillTile;
        let define = |name: &str| kernel_define("prefill_gemm.cu", name);
        let (stages, ring) = (define("PF_STAGES"), define("PF_RING_OFFSET"));
        for (tile, nt, threads, slots) in [
            (
                PrefillTile::Large,
                define("PF_NT"),
                define("PF_THREADS"),
                16,
            ),
            (
                PrefillTile::Small,
                define("PF_NT_SMALL"),
                define("PF_THREADS_SMALL"),
                16,
            ),
            (
                PrefillTile::Wide,
                define("PF_NT_WIDE"),
                define("PF_THREADS_WIDE"),
                define("PF_THREADS_WIDE") / 32,
            ),
            (
                PrefillTile::Dual,
                define("PF_NT"),
                define("PF_THREADS_DUAL"),
                define("PF_THREADS_DUAL") / 32,
            ),
        ] {
            assert_eq!(tile.tokens(), nt);
            assert_eq!(tile.threads(), threads, "{tile:?}");
            assert_eq!(tile.slots(), slots, "{tile:?}");
            // pf_stage_bytes: rounded up to the 1024-byte swizzle atom.
            let stage = (nt * 128 + slots * (512 + 64)).div_ceil(1024) * 1024;
            assert_eq!(tile.shared_bytes(), ring + stages * stage, "{tile:?}");
            // The host's tensor map boxes are the rows the kernel loads per box (PF_BOX_ROWS).
            let box_rows = if tile == PrefillTile::Small {
                define("PF_BOX_ROWS_SMALL")
            } else {
                define("PF_BOX_ROWS_LARGE")
            };
            assert_eq!(tile.box_rows() as usize, box_rows, "{tile:?}");
        }
        // The row table (cp.async tiles only) and the tile fit below the ring.
        assert!(4 * (define("PF_NT") + 2) <= ring);
        assert_eq!(
            PrefillTile::Small.blocks_per_sm(),
            define("PF_SMALL_BLOCKS")
        );
        assert_eq!(PrefillTile::Dual.blocks_per_sm(), define("PF_DUAL_BLOCKS"));
    }

    #[test]
    fn ptxas_report_is_parsed() {
        let log = "ptxas info    : Compiling entry function 'gemm2_nvfp4_n2' for 'sm_90a'\n\
                   ptxas info    : Function properties for gemm2_nvfp4_n2\n\
                   ptxas         .    8 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads\n\
                   ptxas info    : Used 64 registers, used 1 barriers, 512 bytes smem, 400 bytes cmem[0]\n";
        let u = parse_ptxas(log);
        assert_eq!(
            u,
            vec![KernelUsage {
                kernel: "gemm2_nvfp4_n2".into(),
                registers: 64,
                shared_bytes: 512,
                spill_stores: 4,
                spill_loads: 4,
                stack_bytes: 8,
            }]
        );
    }
}
