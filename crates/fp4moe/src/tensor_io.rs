//! Reading and writing safetensors files with errors that name the file and the tensor.
//! Files are written to a temporary name in the destination folder and renamed, so a reader
//! never sees a half-written file and an existing file survives a failed write.

use crate::error::{Error, Result};
use half::bf16;
use safetensors::tensor::{Dtype, SafeTensors, TensorView, View};
use std::borrow::Cow;
use std::collections::HashMap;
use std::io::Write;
use std::path::{Path, PathBuf};

/// A parsed safetensors buffer and the path it came from.
pub struct TensorReader<'a> {
    pub path: &'a Path,
    st: SafeTensors<'a>,
    metadata: HashMap<String, String>,
}

/// Reads a whole file into memory, naming it in the error.
pub fn read_file(path: &Path) -> Result<Vec<u8>> {
    std::fs::read(path).map_err(|e| Error::io(path, e))
}

impl<'a> TensorReader<'a> {
    /// Parses `bytes` (the contents of `path`); a truncated or inconsistent file is an error.
    pub fn new(path: &'a Path, bytes: &'a [u8]) -> Result<Self> {
        let st = SafeTensors::deserialize(bytes).map_err(|e| Error::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        let (_, meta) = SafeTensors::read_metadata(bytes).map_err(|e| Error::Safetensors {
            path: path.to_path_buf(),
            message: e.to_string(),
        })?;
        Ok(Self {
            path,
            st,
            metadata: meta.metadata().clone().unwrap_or_default(),
        })
    }

    pub fn metadata(&self, key: &str) -> Option<&str> {
        self.metadata.get(key).map(String::as_str)
    }

    pub fn names(&self) -> Vec<String> {
        let mut n: Vec<String> = self.st.names().into_iter().map(str::to_string).collect();
        n.sort();
        n
    }

    pub fn contains(&self, name: &str) -> bool {
        self.st.tensor(name).is_ok()
    }

    /// An error about tensor `name` of this file.
    pub fn err(&self, name: &str, message: impl std::fmt::Display) -> Error {
        Error::File {
            path: self.path.to_path_buf(),
            message: format!("tensor `{name}`: {message}"),
        }
    }

    pub fn view(&self, name: &str) -> Result<TensorView<'a>> {
        self.st.tensor(name).map_err(|_| self.err(name, "missing"))
    }

    pub fn shape(&self, name: &str) -> Result<Vec<usize>> {
        Ok(self.view(name)?.shape().to_vec())
    }

    fn check_shape(&self, name: &str, got: &[usize], want: &[usize]) -> Result<()> {
        if got != want {
            return Err(self.err(name, format!("expected shape {want:?}, got {got:?}")));
        }
        Ok(())
    }

    /// An F32 or BF16 tensor of exactly `shape`, as f32.
    pub fn f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let v = self.view(name)?;
        self.check_shape(name, v.shape(), shape)?;
        self.to_f32(name, &v)
    }

    /// An F32/BF16 tensor of any shape.
    pub fn f32_any(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)> {
        let v = self.view(name)?;
        Ok((self.to_f32(name, &v)?, v.shape().to_vec()))
    }

    fn to_f32(&self, name: &str, v: &TensorView<'_>) -> Result<Vec<f32>> {
        match v.dtype() {
            Dtype::F32 => Ok(v
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()),
            Dtype::BF16 => Ok(v
                .data()
                .chunks_exact(2)
                .map(|b| bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()),
            d => Err(self.err(name, format!("expected dtype F32 or BF16, got {d}"))),
        }
    }

    /// A 0-d or `[1]` F32 scalar.
    pub fn scalar_f32(&self, name: &str) -> Result<f32> {
        let v = self.view(name)?;
        if v.shape().iter().product::<usize>() != 1 || v.shape().len() > 1 {
            return Err(self.err(
                name,
                format!("expected a scalar (shape [] or [1]), got {:?}", v.shape()),
            ));
        }
        Ok(self.to_f32(name, &v)?[0])
    }

    /// Raw bytes of a one-byte-per-element tensor of exactly `shape` whose dtype is one of `dtypes`.
    pub fn bytes(&self, name: &str, shape: &[usize], dtypes: &[Dtype]) -> Result<Vec<u8>> {
        let v = self.view(name)?;
        if !dtypes.contains(&v.dtype()) {
            let want: Vec<String> = dtypes.iter().map(|d| d.to_string()).collect();
            return Err(self.err(
                name,
                format!("expected dtype {}, got {}", want.join(" or "), v.dtype()),
            ));
        }
        self.check_shape(name, v.shape(), shape)?;
        Ok(v.data().to_vec())
    }

    /// Every tensor as an owned copy, sorted by name (to edit and write back).
    pub fn owned(&self) -> Result<Vec<(String, OwnedTensor)>> {
        self.names()
            .into_iter()
            .map(|n| {
                let v = self.view(&n)?;
                let t = OwnedTensor::bytes(v.dtype(), v.shape().to_vec(), v.data().to_vec());
                Ok((n, t))
            })
            .collect()
    }

    pub fn i32(&self, name: &str, shape: &[usize]) -> Result<Vec<i32>> {
        let v = self.view(name)?;
        if v.dtype() != Dtype::I32 {
            return Err(self.err(name, format!("expected dtype I32, got {}", v.dtype())));
        }
        self.check_shape(name, v.shape(), shape)?;
        Ok(v.data()
            .chunks_exact(4)
            .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect())
    }
}

/// An owned tensor to write.
#[derive(Clone, Debug)]
pub struct OwnedTensor {
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: Vec<u8>,
}

impl OwnedTensor {
    pub fn f32(shape: Vec<usize>, v: &[f32]) -> Self {
        Self {
            dtype: Dtype::F32,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    pub fn i32(shape: Vec<usize>, v: &[i32]) -> Self {
        Self {
            dtype: Dtype::I32,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    pub fn bf16(shape: Vec<usize>, v: &[bf16]) -> Self {
        Self {
            dtype: Dtype::BF16,
            shape,
            data: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
        }
    }

    pub fn bytes(dtype: Dtype, shape: Vec<usize>, data: Vec<u8>) -> Self {
        Self { dtype, shape, data }
    }
}

impl View for &OwnedTensor {
    fn dtype(&self) -> Dtype {
        self.dtype
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.data)
    }
    fn data_len(&self) -> usize {
        self.data.len()
    }
}

/// Serializes tensors (and string metadata) to safetensors bytes.
pub fn serialize(
    tensors: &[(String, OwnedTensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<Vec<u8>> {
    safetensors::serialize(tensors.iter().map(|(n, t)| (n.as_str(), t)), metadata).map_err(|e| {
        Error::File {
            path: PathBuf::new(),
            message: format!("cannot serialize tensors: {e}"),
        }
    })
}

/// Writes `bytes` to `path` through a temporary file in the same folder and a rename.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .ok_or_else(|| Error::arg("output", format!("{} is not a file path", path.display())))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(bytes)?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if let Err(e) = result {
        let _ = std::fs::remove_file(&tmp);
        return Err(Error::io(path, e));
    }
    Ok(())
}

/// Pretty-printed JSON, written atomically.
pub fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    let text = serde_json::to_string_pretty(v).map_err(|e| Error::File {
        path: path.to_path_buf(),
        message: format!("cannot serialize JSON: {e}"),
    })?;
    write_atomic(path, text.as_bytes())
}

/// Builds folder `dir` through `fill` in a temporary sibling folder, then renames it into
/// place (replacing an existing `dir` only when `replace`), so an interrupted write leaves
/// nothing half-written; the temporary folder is removed on failure.
pub fn write_dir_atomic(
    dir: &Path,
    replace: bool,
    fill: impl FnOnce(&Path) -> Result<()>,
) -> Result<()> {
    if dir.exists() && !replace {
        return Err(Error::arg(
            "output",
            format!("{} exists; refusing to overwrite it", dir.display()),
        ));
    }
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "output".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let result = (|| -> Result<()> {
        let _ = std::fs::remove_dir_all(&tmp);
        std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
        fill(&tmp)?;
        if dir.exists() {
            std::fs::remove_dir_all(dir).map_err(|e| Error::io(dir, e))?;
        }
        std::fs::rename(&tmp, dir).map_err(|e| Error::io(dir, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// [`serialize`] then [`write_atomic`].
pub fn write_tensors(
    path: &Path,
    tensors: &[(String, OwnedTensor)],
    metadata: Option<HashMap<String, String>>,
) -> Result<()> {
    let bytes = serialize(tensors, metadata)?;
    write_atomic(path, &bytes)
}
