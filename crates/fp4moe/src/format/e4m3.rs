//! FP8 E4M3 (`float8_e4m3fn`) block scales: bias 7, 3 mantissa bits, max 448, no Inf,
//! NaN = `0x7F`/`0xFF`. Subnormals are `m/8 · 2^-6`, the smallest `2^-9`.
//!
//! Encoding is round-to-nearest-even with saturation to ±448 (CUDA's `__NV_SATFINITE`):
//! every E4M3 value is `q · 2^(e-3)` with an integer `q`, so rounding reduces to rounding
//! `|x| / 2^(e-3)` to an integer, which is exact to compute because the divisor is a power of two.

/// Largest finite E4M3 value.
pub const E4M3_MAX: f32 = 448.0;
/// Canonical NaN byte.
pub const E4M3_NAN: u8 = 0x7F;

/// Value of an E4M3 byte (NaN for `0x7F`/`0xFF`).
#[inline(always)]
pub fn decode(b: u8) -> f32 {
    DECODE[b as usize]
}

/// Whether the byte is one of the two NaN encodings.
#[inline(always)]
pub fn is_nan(b: u8) -> bool {
    b & 0x7F == 0x7F
}

const fn decode_const(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let e = ((b >> 3) & 0xF) as i32;
    let m = (b & 7) as f32;
    if e == 15 && (b & 7) == 7 {
        return f32::NAN;
    }
    // 2^(e-7) and 2^-6 built by repeated halving/doubling so this stays `const`.
    let mut p = 1.0f32;
    let mut k = if e == 0 { -6 } else { e - 7 };
    while k > 0 {
        p *= 2.0;
        k -= 1;
    }
    while k < 0 {
        p *= 0.5;
        k += 1;
    }
    if e == 0 {
        sign * (m / 8.0) * p
    } else {
        sign * (1.0 + m / 8.0) * p
    }
}

const fn build_decode() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    let mut i = 0;
    while i < 256 {
        t[i] = decode_const(i as u8);
        i += 1;
    }
    t
}

static DECODE: [f32; 256] = build_decode();

/// Nearest E4M3 byte to `x`, ties to even, saturating at ±448; NaN gives [`E4M3_NAN`].
pub fn encode_sat(x: f32) -> u8 {
    if x.is_nan() {
        return E4M3_NAN;
    }
    let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
    let a = x.abs();
    if a >= E4M3_MAX {
        return sign | 0x7E;
    }
    // Quantum of the binade holding `a` (2^-9 for the subnormal range).
    let exp = if a < 2f32.powi(-6) {
        -6
    } else {
        ((a.to_bits() >> 23) as i32) - 127
    };
    let quantum = 2f32.powi(exp - 3);
    let q = (a / quantum).round_ties_even() as u32; // in [0, 16]
    let code = if exp == -6 && q < 8 {
        q // subnormal (or zero)
    } else {
        // q in [8, 16]; q == 16 carries into the next binade, which the bit layout does for us.
        (((exp + 7) as u32) << 3) + (q - 8)
    };
    sign | (code.min(0x7E) as u8)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(decode(0x7E), 448.0);
        assert_eq!(decode(0x38), 1.0);
        assert_eq!(decode(0x01), 2f32.powi(-9));
        assert_eq!(decode(0x08), 2f32.powi(-6));
        assert_eq!(decode(0x59), 18.0);
        assert!(decode(0x7F).is_nan() && decode(0xFF).is_nan());
        assert_eq!(decode(0x80), 0.0);
    }

    #[test]
    fn cast_facts() {
        // DESIGN/anchors 1.9, with saturation instead of NaN above 464.
        assert_eq!(encode_sat(448.0), 0x7E);
        assert_eq!(encode_sat(449.0), 0x7E);
        assert_eq!(encode_sat(464.0), 0x7E);
        assert_eq!(encode_sat(1e9), 0x7E);
        assert_eq!(encode_sat(f32::INFINITY), 0x7E);
        assert_eq!(encode_sat(2f32.powi(-10)), 0x00);
        assert_eq!(encode_sat(1.5 * 2f32.powi(-10)), 0x01);
        assert_eq!(encode_sat(17.92), 0x59);
        assert_eq!(encode_sat(f32::NAN), E4M3_NAN);
        assert_eq!(encode_sat(-1.0), 0xB8);
    }

    #[test]
    fn every_finite_byte_round_trips() {
        for b in 0u8..=255 {
            if is_nan(b) || b == 0x80 {
                continue;
            }
            assert_eq!(encode_sat(decode(b)), b, "byte {b:#04x}");
        }
    }

    #[test]
    fn midpoints_round_to_even() {
        // Between consecutive positive finite values, the midpoint goes to the even code
        // and anything off the midpoint goes to the nearer neighbour.
        for b in 0u8..0x7E {
            let lo = decode(b) as f64;
            let hi = decode(b + 1) as f64;
            let mid = ((lo + hi) / 2.0) as f32;
            let even = if b % 2 == 0 { b } else { b + 1 };
            assert_eq!(encode_sat(mid), even, "midpoint of {b:#04x}");
            let below = f32::from_bits(mid.to_bits() - 1);
            let above = f32::from_bits(mid.to_bits() + 1);
            assert_eq!(encode_sat(below), b);
            assert_eq!(encode_sat(above), b + 1);
        }
    }
}
