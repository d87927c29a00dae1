//! Bit-exactness of the NVFP4 quantizers on the golden data (DESIGN 1, 6).

mod common;

use fp4moe::format::{activation, Nvfp4Tensor};
use fp4moe::tensor_io::{read_file, TensorReader};
use safetensors::tensor::Dtype;

fn cases(r: &TensorReader<'_>) -> Vec<String> {
    let mut c: Vec<String> = r
        .names()
        .iter()
        .filter_map(|n| n.strip_suffix(".input").map(str::to_string))
        .collect();
    c.sort();
    c
}

#[test]
fn weight_quantizer_is_bit_exact() {
    let path = common::golden("nvfp4_weights.safetensors");
    let bytes = read_file(&path).unwrap();
    let r = TensorReader::new(&path, &bytes).unwrap();
    let names = cases(&r);
    assert!(names.len() >= 6, "{names:?}");
    for c in names {
        let (input, shape) = r.f32_any(&format!("{c}.input")).unwrap();
        let (rows, cols) = (shape[0], shape[1]);
        let t = Nvfp4Tensor::quantize(&c, &input, rows, cols).unwrap();
        let want_s2 = r.scalar_f32(&format!("{c}.weight_scale_2")).unwrap();
        assert_eq!(t.scale_2.to_bits(), want_s2.to_bits(), "{c}: scale_2");
        let want_scales = r
            .bytes(
                &format!("{c}.weight_scale"),
                &[rows, cols / 16],
                &[Dtype::U8],
            )
            .unwrap();
        assert_eq!(t.scales, want_scales, "{c}: block scales");
        let want_packed = r
            .bytes(&format!("{c}.weight"), &[rows, cols / 2], &[Dtype::U8])
            .unwrap();
        assert_eq!(t.packed, want_packed, "{c}: packed codes");
        let want_deq = r.f32(&format!("{c}.dequantized"), &[rows, cols]).unwrap();
        let got: Vec<u32> = t.dequantize().iter().map(|v| v.to_bits()).collect();
        let want: Vec<u32> = want_deq.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{c}: dequantized");
    }
}

#[test]
fn activation_quantizer_is_bit_exact() {
    let path = common::golden("nvfp4_activations.safetensors");
    let bytes = read_file(&path).unwrap();
    let r = TensorReader::new(&path, &bytes).unwrap();
    let names = cases(&r);
    assert!(names.len() >= 4, "{names:?}");
    for c in names {
        let (input, shape) = r.f32_any(&format!("{c}.input")).unwrap();
        let (rows, cols) = (shape[0], shape[1]);
        let gs = 1.0 / r.scalar_f32(&format!("{c}.input_scale")).unwrap();
        let want_packed = r
            .bytes(&format!("{c}.packed"), &[rows, cols / 2], &[Dtype::U8])
            .unwrap();
        let want_scales = r
            .bytes(&format!("{c}.scale"), &[rows, cols / 16], &[Dtype::U8])
            .unwrap();
        let want_qdq = r.f32(&format!("{c}.qdq"), &[rows, cols]).unwrap();
        let mut packed = vec![0u8; rows * cols / 2];
        let mut scales = vec![0u8; rows * cols / 16];
        let mut qdq = vec![0.0f32; rows * cols];
        for i in 0..rows {
            let x = &input[i * cols..(i + 1) * cols];
            activation::quantize_row(
                x,
                gs,
                &mut packed[i * cols / 2..(i + 1) * cols / 2],
                &mut scales[i * cols / 16..(i + 1) * cols / 16],
            );
            activation::qdq_row(x, gs, &mut qdq[i * cols..(i + 1) * cols]);
        }
        assert_eq!(scales, want_scales, "{c}: scales");
        assert_eq!(packed, want_packed, "{c}: packed");
        let got: Vec<u32> = qdq.iter().map(|v| v.to_bits()).collect();
        let want: Vec<u32> = want_qdq.iter().map(|v| v.to_bits()).collect();
        assert_eq!(got, want, "{c}: qdq");
    }
}
