//! E2M1 (FP4) elements: 1 sign bit, 2 exponent bits, 1 mantissa bit, no Inf/NaN.
//!
//! Nibble layout: bit 3 is the sign, bits 0..2 the magnitude code whose values are
//! `{0, 0.5, 1, 1.5, 2, 3, 4, 6}`. Packing: a row of K elements is K/2 bytes; byte `j`
//! holds element `2j` in the low nibble and `2j + 1` in the high nibble (DESIGN 1).

/// Magnitudes of the eight E2M1 codes.
pub const E2M1_VALUES: [f32; 8] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0];

/// Largest finite E2M1 magnitude.
pub const E2M1_MAX: f32 = 6.0;

/// Value of one nibble (sign included). Only the low 4 bits of `nibble` are read. The
/// negative-zero code `0x8` decodes to +0, as the golden data and a zeroed accumulator have it.
#[inline(always)]
pub fn decode(nibble: u8) -> f32 {
    let mag = E2M1_VALUES[(nibble & 7) as usize];
    if nibble & 7 != 0 && nibble & 8 != 0 {
        -mag
    } else {
        mag
    }
}

/// Signed values of all 16 nibbles, for table-driven dequantization.
pub const fn decode_table() -> [f32; 16] {
    let mut t = [0.0f32; 16];
    let mut i = 0;
    while i < 8 {
        t[i] = E2M1_VALUES[i];
        t[i + 8] = if i == 0 { 0.0 } else { -E2M1_VALUES[i] };
        i += 1;
    }
    t
}

/// Magnitude code of `|v|` rounded to nearest, ties to the even mantissa, saturating at 6.
///
/// Ties: 0.25→0, 0.75→1, 1.25→1, 1.75→2, 2.5→2, 3.5→4, 5→4. Written as interval thresholds
/// (the form vLLM's and ModelOpt's references use), which is exactly round-half-to-even.
/// NaN maps to 0; callers reject non-finite input before quantizing.
#[inline(always)]
pub fn encode_magnitude(v: f32) -> u8 {
    let a = v.abs();
    if a <= 0.25 {
        0
    } else if a < 0.75 {
        1
    } else if a <= 1.25 {
        2
    } else if a < 1.75 {
        3
    } else if a <= 2.5 {
        4
    } else if a < 3.5 {
        5
    } else if a <= 5.0 {
        6
    } else if a > 5.0 {
        7
    } else {
        0 // NaN
    }
}

/// Full nibble: magnitude code of `v` with the sign bit set iff `negative`.
#[inline(always)]
pub fn encode(v: f32, negative: bool) -> u8 {
    encode_magnitude(v) | if negative { 8 } else { 0 }
}

/// Packs two nibbles: `even` goes to the low half, `odd` to the high half.
#[inline(always)]
pub fn pack(even: u8, odd: u8) -> u8 {
    (even & 0xF) | (odd << 4)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ties_round_to_even() {
        let cases = [
            (0.25, 0.0),
            (0.2501, 0.5),
            (0.75, 1.0),
            (1.25, 1.0),
            (1.75, 2.0),
            (2.5, 2.0),
            (3.5, 4.0),
            (5.0, 4.0),
            (5.0001, 6.0),
            (100.0, 6.0),
            (f32::INFINITY, 6.0),
        ];
        for (v, want) in cases {
            assert_eq!(E2M1_VALUES[encode_magnitude(v) as usize], want, "v = {v}");
        }
    }

    #[test]
    fn every_code_round_trips() {
        assert_eq!(decode(8).to_bits(), 0.0f32.to_bits());
        for n in (0u8..16).filter(|&n| n != 8) {
            let v = decode(n);
            let back = encode(v, n & 8 != 0);
            assert_eq!(back, n);
        }
    }

    #[test]
    fn rounds_to_nearest() {
        // Exhaustive over a dense grid: the chosen value is never farther than another one.
        let mut v = 0.0f32;
        while v < 8.0 {
            let got = E2M1_VALUES[encode_magnitude(v) as usize];
            for c in E2M1_VALUES {
                assert!(
                    (got - v).abs() <= (c - v).abs() || v > 6.0,
                    "v={v} got={got} c={c}"
                );
            }
            v += 1.0 / 64.0;
        }
    }

    /// The CUDA kernels' quantize-dequantize (`nvfp4_qdq` in kernels/common.cuh) rounds by the
    /// grid spacing instead of comparing with thresholds: |y| times the inverse spacing of its
    /// binade, rounded to the nearest integer with ties to even, times the spacing. Both must
    /// pick the same grid value for every f32; exhaustive over [0, 8] (saturation included).
    #[test]
    fn rounding_by_spacing_equals_thresholds() {
        fn by_spacing(y: f32) -> f32 {
            let a = y.abs().min(E2M1_MAX);
            let (scale, spacing) = if a < 2.0 {
                (2.0, 0.5)
            } else if a < 4.0 {
                (1.0, 1.0)
            } else {
                (0.5, 2.0)
            };
            (a * scale).round_ties_even() * spacing
        }
        for bits in 0..=8.0f32.to_bits() {
            let y = f32::from_bits(bits);
            let want = E2M1_VALUES[encode_magnitude(y) as usize];
            assert_eq!(
                by_spacing(y).to_bits(),
                want.to_bits(),
                "y = {y:e} ({bits:#x})"
            );
        }
        assert_eq!(by_spacing(f32::INFINITY), 6.0);
        assert_eq!(by_spacing(-1.75), 2.0); // the magnitude; the kernel applies the sign
    }

    #[test]
    fn packing_puts_even_element_low() {
        assert_eq!(pack(0x3, 0xA), 0xA3);
        let t = decode_table();
        assert_eq!(t[0xA], -1.0);
        assert_eq!(t[0x7], 6.0);
    }
}
