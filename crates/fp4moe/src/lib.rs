//! fp4moe: NVFP4 Mixture-of-Experts layers.
//!
//! - [`format`](mod@format): NVFP4 (E2M1 + E4M3 block scales + per-tensor scale), bit-exact quantizers.
//! - [`spec`], [`weights`], [`routing`]: what a layer computes and holds (DESIGN 2).
//! - [`layout`]: backend weight layouts (gate/up interleave, scale_2 folding).
//! - [`backend`]: capability declarations and selection; backends `reference` (f64 oracle) and
//!   `cpu` (fast multi-threaded path).
//! - [`moe::MoeLayer`]: a layer bound to a backend.
//! - [`layer_file`], [`tensor_io`], [`quantize_file`]: safetensors formats.

pub mod backend;
pub mod calibration;
pub mod checkpoint;
mod cpu;
pub mod cuda;
pub mod error;
pub mod format;
pub mod layer_file;
pub mod layout;
pub mod moe;
pub mod quantize_file;
mod reference;
pub mod routing;
pub mod spec;
pub mod synthetic;
pub mod tensor_io;
pub mod weights;

pub use backend::{Backend, Workspace};
pub use error::{Error, Result};
pub use moe::{BackendChoice, MoeLayer};
