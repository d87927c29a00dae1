//! Fuzzes the `run-layer` file format: arbitrary bytes as a layer file. Any outcome but a panic
//! is fine.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let path = std::env::temp_dir().join(format!("fp4moe-fuzz-layer-{}.safetensors", std::process::id()));
    if std::fs::write(&path, data).is_ok() {
        let _ = fp4moe::layer_file::read(&path);
    }
});
