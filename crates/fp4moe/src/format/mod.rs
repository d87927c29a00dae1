//! The NVFP4 format: E2M1 elements, E4M3 block scales, the weight and activation quantizers,
//! and the 128x4 scale swizzle. Everything here is bit-exact against DESIGN section 1.

pub mod activation;
pub mod e2m1;
pub mod e4m3;
pub mod nvfp4;
pub mod swizzle;

pub use nvfp4::Nvfp4Tensor;

/// Elements per block scale.
pub const BLOCK: usize = 16;

/// Errors about tensor contents and shapes. Every variant names the tensor.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FormatError {
    #[error(
        "tensor `{tensor}`: non-finite value {value} at [{row}, {col}]; NVFP4 cannot represent it"
    )]
    NonFinite {
        tensor: String,
        row: usize,
        col: usize,
        value: f32,
    },
    #[error(
        "tensor `{tensor}`: {cols} columns is not a positive multiple of 16 (the NVFP4 block size)"
    )]
    ColsNotMultipleOf16 { tensor: String, cols: usize },
    #[error("tensor `{tensor}`: expected shape {expected:?}, got {got:?}")]
    Shape {
        tensor: String,
        expected: Vec<usize>,
        got: Vec<usize>,
    },
    #[error("tensor `{tensor}`: expected dtype {expected}, got {got}")]
    Dtype {
        tensor: String,
        expected: String,
        got: String,
    },
    #[error(
        "tensor `{tensor}`: block scale byte {byte:#04x} at [{row}, {col}] is NaN or negative"
    )]
    BadScaleByte {
        tensor: String,
        row: usize,
        col: usize,
        byte: u8,
    },
    #[error("tensor `{tensor}`: scale {value} must be finite and non-negative")]
    BadScale { tensor: String, value: f32 },
    #[error("tensor `{tensor}` is missing")]
    Missing { tensor: String },
}
