//! Shared test helpers: golden data location, per-backend instantiation, tolerances.
#![allow(dead_code)]

use std::path::PathBuf;

/// `FP4MOE_GOLDEN_DIR`, or `../shared/golden` from the workspace root. Missing golden data is a
/// test failure, never a skip.
pub fn golden_dir() -> PathBuf {
    let dir = match std::env::var_os("FP4MOE_GOLDEN_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden"),
    };
    assert!(
        dir.join("nvfp4_weights.safetensors").is_file(),
        "golden data not found in {} (set FP4MOE_GOLDEN_DIR)",
        dir.display()
    );
    dir
}

pub fn golden(name: &str) -> PathBuf {
    golden_dir().join(name)
}

/// Every `moe_*.safetensors` case, sorted.
pub fn moe_cases() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(golden_dir())
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("moe_") && n.ends_with(".safetensors"))
        })
        .collect();
    v.sort();
    assert!(
        v.len() >= 8,
        "expected the 8 golden MoE cases, found {}",
        v.len()
    );
    v
}

/// Whether the CUDA backend can run here. Without one the test is skipped loudly, unless
/// `FP4MOE_REQUIRE_GPU=1`, where a GPU test that cannot run fails.
pub fn gpu_available() -> bool {
    match fp4moe::Backend::Cuda.availability() {
        Ok(()) => true,
        Err(reason) => {
            if std::env::var("FP4MOE_REQUIRE_GPU").is_ok_and(|v| v == "1") {
                panic!("FP4MOE_REQUIRE_GPU=1 but the CUDA backend cannot run: {reason}");
            }
            // Straight to stderr: the harness captures eprintln! of passing tests, and a skip
            // must be visible in CI logs.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "skipped: no CUDA driver or device ({reason})"
            );
            false
        }
    }
}

/// Instantiates `fn $case(backend: Backend)` once per backend as `$case::{reference, cpu, cuda}`.
#[macro_export]
macro_rules! per_backend {
    ($($case:ident),* $(,)?) => {
        $(
            mod $case {
                #[test]
                fn reference() {
                    super::$case(fp4moe::Backend::Reference);
                }
                #[test]
                fn cpu() {
                    super::$case(fp4moe::Backend::Cpu);
                }
                #[test]
                fn cuda() {
                    if $crate::common::gpu_available() {
                        super::$case(fp4moe::Backend::Cuda);
                    }
                }
            }
        )*
    };
}
