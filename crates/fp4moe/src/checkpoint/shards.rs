//! The safetensors files of a checkpoint directory, memory-mapped: `model.safetensors`, or the
//! shards `model.safetensors.index.json` names. Headers are parsed and checked once at open;
//! tensor bytes are only touched when a tensor is read, so loading one layer reads one layer.

use crate::error::{Error, Result};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, SafeTensors};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

struct Shard {
    path: PathBuf,
    mmap: Mmap,
    data_start: usize,
    meta: Metadata,
}

/// One tensor of a checkpoint, borrowed from its mapped shard.
pub struct TensorRef<'a> {
    pub name: &'a str,
    pub shard: &'a Path,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    pub data: &'a [u8],
}

/// The tensors of a checkpoint directory.
pub struct CheckpointFiles {
    pub dir: PathBuf,
    shards: Vec<Shard>,
    index: HashMap<String, usize>,
}

fn open_shard(path: &Path) -> Result<Shard> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    // SAFETY: the file is opened read-only and the map is never written. Like every reader of
    // memory-mapped files we rely on no other process truncating the checkpoint while it is
    // loaded (documented in the README's limits).
    let mmap = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
    // Full validation (header, offsets, data length) once, here.
    SafeTensors::deserialize(&mmap).map_err(|e| Error::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    let (header_len, meta) = SafeTensors::read_metadata(&mmap).map_err(|e| Error::Safetensors {
        path: path.to_path_buf(),
        message: e.to_string(),
    })?;
    Ok(Shard {
        path: path.to_path_buf(),
        data_start: 8 + header_len,
        mmap,
        meta,
    })
}

impl CheckpointFiles {
    /// Opens `dir/model.safetensors.index.json` and its shards, or `dir/model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        if index_path.is_file() {
            let text =
                std::fs::read_to_string(&index_path).map_err(|e| Error::io(&index_path, e))?;
            let v: serde_json::Value = serde_json::from_str(&text)
                .map_err(|e| Error::file(&index_path, format!("not valid JSON: {e}")))?;
            let map = v
                .get("weight_map")
                .and_then(|m| m.as_object())
                .ok_or_else(|| Error::file(&index_path, "field `weight_map` is missing"))?;
            let mut by_file: HashMap<String, usize> = HashMap::new();
            let mut entries: Vec<(&String, &serde_json::Value)> = map.iter().collect();
            entries.sort_by(|a, b| a.0.cmp(b.0));
            for (name, file) in entries {
                let file = file.as_str().ok_or_else(|| {
                    Error::file(
                        &index_path,
                        format!("weight_map entry `{name}` is not a file name"),
                    )
                })?;
                if file.contains('/') || file.contains("..") {
                    return Err(Error::file(&index_path, format!("weight_map entry `{name}` names `{file}` outside the checkpoint folder")));
                }
                let i = match by_file.get(file) {
                    Some(&i) => i,
                    None => {
                        let path = dir.join(file);
                        if !path.is_file() {
                            return Err(Error::file(
                                &index_path,
                                format!("shard `{file}` (holding `{name}`) does not exist"),
                            ));
                        }
                        shards.push(open_shard(&path)?);
                        by_file.insert(file.to_string(), shards.len() - 1);
                        shards.len() - 1
                    }
                };
                if shards[i].meta.info(name).is_none() {
                    return Err(Error::file(
                        &shards[i].path,
                        format!(
                            "tensor `{name}` is listed in the index but missing from this shard"
                        ),
                    ));
                }
                index.insert(name.clone(), i);
            }
        } else {
            let path = dir.join("model.safetensors");
            if !path.is_file() {
                return Err(Error::file(
                    dir,
                    "neither model.safetensors nor model.safetensors.index.json is here",
                ));
            }
            shards.push(open_shard(&path)?);
            for name in shards[0].meta.tensors().keys() {
                index.insert(name.clone(), 0);
            }
        }
        Ok(Self {
            dir: dir.to_path_buf(),
            shards,
            index,
        })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut n: Vec<&str> = self.index.keys().map(String::as_str).collect();
        n.sort_unstable();
        n
    }

    /// Each shard file with the tensors it holds (sorted), in file order.
    pub fn shard_contents(&self) -> Vec<(&Path, Vec<&str>)> {
        self.shards
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let mut names: Vec<&str> = self
                    .index
                    .iter()
                    .filter(|(_, &j)| j == i)
                    .map(|(n, _)| n.as_str())
                    .collect();
                names.sort_unstable();
                (s.path.as_path(), names)
            })
            .collect()
    }

    /// The shard files.
    pub fn shard_paths(&self) -> Vec<&Path> {
        self.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// Tensor `name`, or an error naming it and the checkpoint.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let (key, &i) = self
            .index
            .get_key_value(name)
            .ok_or_else(|| Error::file(&self.dir, format!("tensor `{name}` is missing")))?;
        let s = &self.shards[i];
        let info = s
            .meta
            .info(name)
            .ok_or_else(|| Error::file(&s.path, format!("tensor `{name}` is missing")))?;
        let (a, b) = info.data_offsets;
        let data = s
            .mmap
            .get(s.data_start + a..s.data_start + b)
            .ok_or_else(|| {
                Error::file(
                    &s.path,
                    format!("tensor `{name}`: data offsets lie outside the file"),
                )
            })?;
        Ok(TensorRef {
            name: key,
            shard: &s.path,
            dtype: info.dtype,
            shape: info.shape.clone(),
            data,
        })
    }
}

impl TensorRef<'_> {
    pub fn err(&self, message: impl std::fmt::Display) -> Error {
        Error::file(self.shard, format!("tensor `{}`: {message}", self.name))
    }

    /// F32/BF16 values (any shape).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        match self.dtype {
            Dtype::F32 => Ok(self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect()),
            Dtype::BF16 => Ok(self
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect()),
            d => Err(self.err(format!("expected dtype F32 or BF16, got {d}"))),
        }
    }

    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape != shape {
            return Err(self.err(format!("expected shape {shape:?}, got {:?}", self.shape)));
        }
        Ok(())
    }

    /// A 0-d or `[1]` F32/BF16 scalar.
    pub fn scalar(&self) -> Result<f32> {
        if self.shape.len() > 1 || self.shape.iter().product::<usize>() != 1 {
            return Err(self.err(format!(
                "expected a scalar (shape [] or [1]), got {:?}",
                self.shape
            )));
        }
        Ok(self.to_f32()?[0])
    }

    /// Bytes of a one-byte dtype among `dtypes`, with `shape`.
    pub fn bytes(&self, shape: &[usize], dtypes: &[Dtype]) -> Result<&[u8]> {
        if !dtypes.contains(&self.dtype) {
            return Err(self.err(format!(
                "expected dtype {}, got {}",
                dtypes
                    .iter()
                    .map(|d| d.to_string())
                    .collect::<Vec<_>>()
                    .join(" or "),
                self.dtype
            )));
        }
        self.expect_shape(shape)?;
        Ok(self.data)
    }
}
