//! The library's error type: one enum over the per-stage errors, each keeping its fields.

use crate::format::FormatError;
use crate::layout::InexactFold;
use crate::spec::SpecError;
use std::path::PathBuf;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Format(#[from] FormatError),
    #[error(transparent)]
    Spec(#[from] SpecError),
    #[error(transparent)]
    Fold(#[from] InexactFold),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: not a valid safetensors file: {message}")]
    Safetensors { path: PathBuf, message: String },
    #[error("{path}: {message}")]
    File { path: PathBuf, message: String },
    #[error("no backend supports this layer:\n{}", .reasons.iter().map(|(b, r)| format!("  - {b}: {r}")).collect::<Vec<_>>().join("\n"))]
    NoBackend { reasons: Vec<(String, String)> },
    #[error("backend `{backend}` does not support this layer: {reason}")]
    Unsupported { backend: String, reason: String },
    #[error("CUDA is not available: {reason}")]
    CudaUnavailable { reason: String },
    #[error("CUDA {stage}: {message}")]
    Cuda {
        stage: &'static str,
        message: String,
    },
    #[error("argument `{name}`: {message}")]
    Argument { name: &'static str, message: String },
}

impl Error {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    /// A problem with the file (or folder) at `path`.
    pub(crate) fn file(path: impl Into<PathBuf>, message: impl Into<String>) -> Self {
        Error::File {
            path: path.into(),
            message: message.into(),
        }
    }

    pub(crate) fn arg(name: &'static str, message: impl Into<String>) -> Self {
        Error::Argument {
            name,
            message: message.into(),
        }
    }
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
