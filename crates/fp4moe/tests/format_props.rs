//! Property tests of the NVFP4 format: error bounds, signs, ties, saturation, zero blocks,
//! E4M3 monotonicity and the parsers' behaviour on corrupted files.

mod common;

use fp4moe::format::activation::{qdq_row, quantize_row};
use fp4moe::format::{e2m1, e4m3, Nvfp4Tensor, BLOCK};
use fp4moe::layer_file;
use proptest::prelude::*;

fn bf16_round(v: f32) -> f32 {
    half::bf16::from_f32(v).to_f32()
}

/// Rows of `cols` finite values with magnitudes spread over many binades, some zero blocks.
fn matrix() -> impl Strategy<Value = (usize, usize, Vec<f32>)> {
    (1usize..5, 1usize..5).prop_flat_map(|(rows, blocks)| {
        let cols = blocks * BLOCK;
        (
            Just(rows),
            Just(cols),
            prop::collection::vec(
                prop_oneof![
                    4 => (-1.0f32..1.0).prop_map(bf16_round),
                    1 => (-1000.0f32..1000.0).prop_map(bf16_round),
                    1 => (-1e-3f32..1e-3).prop_map(bf16_round),
                    1 => Just(0.0f32),
                ],
                rows * cols,
            ),
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn weight_quantization_error_is_bounded((rows, cols, w) in matrix()) {
        let t = Nvfp4Tensor::quantize("w", &w, rows, cols).unwrap();
        let d = t.dequantize();
        for r in 0..rows {
            for c in 0..cols {
                let i = r * cols + c;
                let step = e4m3::decode(t.scales[r * cols / BLOCK + c / BLOCK]) as f64 * t.scale_2 as f64;
                // Half the widest E2M1 gap (4 → 6) is one step; rounding adds a relative hair.
                let bound = step * (1.0 + 1e-6) + 1e-30;
                prop_assert!(((w[i] - d[i]) as f64).abs() <= bound, "w={} d={} step={}", w[i], d[i], step);
                prop_assert!(d[i] == 0.0 || (d[i] < 0.0) == (w[i] < 0.0), "sign of {} became {}", w[i], d[i]);
            }
        }
    }

    #[test]
    fn zero_blocks_stay_zero((rows, cols, mut w) in matrix(), which in 0usize..64) {
        let blocks = rows * cols / BLOCK;
        let b = which % blocks;
        w[b * BLOCK..(b + 1) * BLOCK].fill(0.0);
        let t = Nvfp4Tensor::quantize("w", &w, rows, cols).unwrap();
        let d = t.dequantize();
        prop_assert!(d[b * BLOCK..(b + 1) * BLOCK].iter().all(|v| *v == 0.0));
        // ModelOpt's recipe: a zero block's scale becomes 1.0 (before the 2^-9 clamp), unless the
        // whole tensor is zero, which we also store with unit block scales.
        prop_assert_eq!(t.scales[b], e4m3::encode_sat(1.0));
    }

    #[test]
    fn largest_block_uses_full_range((rows, cols, w) in matrix()) {
        prop_assume!(w.iter().any(|v| *v != 0.0));
        let t = Nvfp4Tensor::quantize("w", &w, rows, cols).unwrap();
        let amax = w.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        prop_assert_eq!(t.scale_2, amax / 2688.0);
        // The block holding the amax gets the largest E4M3 scale (448) and the amax code ±6.
        let i = w.iter().position(|v| v.abs() == amax).unwrap();
        prop_assert_eq!(t.scales[i / BLOCK], 0x7E);
        let nib = (t.packed[i / 2] >> (4 * (i % 2))) & 7;
        prop_assert_eq!(nib, 7);
    }

    #[test]
    fn activation_qdq_matches_its_codes(x in prop::collection::vec((-50.0f32..50.0).prop_map(bf16_round), 32), amax in 0.5f32..100.0) {
        let gs = 2688.0 / amax;
        let mut packed = [0u8; 16];
        let mut scales = [0u8; 2];
        quantize_row(&x, gs, &mut packed, &mut scales);
        let mut q = [0.0f32; 32];
        qdq_row(&x, gs, &mut q);
        for i in 0..32 {
            let code = (packed[i / 2] >> (4 * (i % 2))) & 0xF;
            let want = e2m1::decode(code) * e4m3::decode(scales[i / BLOCK]) / gs;
            prop_assert_eq!(q[i].to_bits(), want.to_bits());
            prop_assert!(e4m3::decode(scales[i / BLOCK]) <= 448.0);
        }
    }

    #[test]
    fn e4m3_is_monotonic_and_nearest(a in 0.0f32..500.0, b in 0.0f32..500.0) {
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        prop_assert!(e4m3::encode_sat(lo) <= e4m3::encode_sat(hi));
        let q = e4m3::encode_sat(a);
        if a < 448.0 && q < 0x7E {
            let d = (e4m3::decode(q) - a).abs();
            prop_assert!(d <= (e4m3::decode(q + 1) - a).abs());
            if q > 0 {
                prop_assert!(d <= (e4m3::decode(q - 1) - a).abs());
            }
        }
    }

    /// A layer file cut anywhere or with a corrupted header byte is an error, never a panic.
    #[test]
    fn corrupted_layer_files_are_errors(cut in 0usize..100_000, pos in 0usize..400, byte in any::<u8>()) {
        let src = common::golden("moe_silu_w4a16_softmax.safetensors");
        let good = std::fs::read(&src).unwrap();
        let dir = std::env::temp_dir().join(format!("fp4moe-prop-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("cut.safetensors");
        std::fs::write(&p, &good[..cut % good.len()]).unwrap();
        prop_assert!(layer_file::read(&p).is_err());
        let mut bad = good.clone();
        bad[8 + pos % 400] = byte;
        std::fs::write(&p, &bad).unwrap();
        let _ = layer_file::read(&p); // Ok if the byte changed nothing that matters; never a panic.
    }
}
