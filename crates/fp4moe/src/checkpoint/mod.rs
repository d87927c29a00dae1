//! ModelOpt NVFP4 checkpoints in the Hugging Face layout (DESIGN 3): `config.json`,
//! `hf_quant_config.json` (or `config.json["quantization_config"]`), `model.safetensors` or shards
//! with `model.safetensors.index.json`. [`Checkpoint::load_layer`] builds one fused MoE layer:
//! gated `gate_proj` → w13 rows `[0, I)`, `up_proj` → `[I, 2I)`, each keeping its own `scale_2`;
//! non-gated `up_proj` alone is w13; `down_proj` is w2. [`write_checkpoint`] writes the same
//! layout (tests, and the quantizer).

pub mod config;
mod load;
mod quantize;
pub mod shards;
pub(crate) mod write;

pub use config::{Family, ModelConfig, QuantAlgo, QuantConfig};
pub use load::{Checkpoint, LayerStats};
pub use quantize::{quantize_checkpoint, QuantizeOptions, QuantizeReport};
pub use write::{write_checkpoint, WriteOptions};
