//! Fuzzes the checkpoint path: `config.json` text and `model.safetensors` bytes from the input
//! (split at the first NUL), written to a scratch folder and opened, every MoE layer loaded and
//! inspected. Any outcome but a panic is fine.
#![no_main]

use fp4moe::checkpoint::Checkpoint;
use fp4moe::spec::QuantMode;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let split = data.iter().position(|&b| b == 0).unwrap_or(data.len());
    let (config, rest) = data.split_at(split);
    let tensors = rest.get(1..).unwrap_or(&[]);
    let dir = std::env::temp_dir().join(format!("fp4moe-fuzz-{}", std::process::id()));
    let _ = std::fs::create_dir_all(&dir);
    let _ = std::fs::write(dir.join("config.json"), config);
    let _ = std::fs::write(
        dir.join("hf_quant_config.json"),
        br#"{"quantization": {"quant_algo": "NVFP4", "group_size": 16, "exclude_modules": ["lm_head"]}}"#,
    );
    let _ = std::fs::write(dir.join("model.safetensors"), tensors);
    if let Ok(ck) = Checkpoint::open(&dir) {
        for &l in ck.moe_layers.clone().iter().take(2) {
            let _ = ck.load_layer(l, None);
            let _ = ck.load_layer(l, Some(QuantMode::W4A16));
            let _ = ck.layer_stats(l);
        }
    }
});
