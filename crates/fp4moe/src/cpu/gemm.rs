//! The CPU micro-kernel: `out[r, j] = Σ_c W[r, c] · a_j[c]` for a block of weight rows against a
//! set of activation rows, with `W` rows produced on the fly (NVFP4 dequantized into a small
//! per-thread buffer, never a full copy).
//!
//! Every dot product has one summation order: eight lane accumulators, lane `l` adding
//! `W[r, c] · a_j[c]` for `c = l, l + 8, l + 16, …` in increasing `c` (a multiply, then an add,
//! never fused), then the lanes summed in order by `iter().sum()`. Only the grouping around it
//! changes, so results are bitwise the same for any blocking and either implementation:
//!
//! - register blocking: one pass over `k` computes four weight rows against two activation rows
//!   (`Dots::TWO_TOKENS`) or one, so each activation chunk feeds four rows and each weight
//!   chunk read from the buffer feeds two tokens (rows and tokens left over run as smaller
//!   blocks);
//! - on x86-64 CPUs with AVX (checked at run time) the lanes of an accumulator are one 256-bit
//!   register, written with intrinsics: the portable code compiled for AVX2 was no faster than
//!   before, as LLVM packed the four rows into a register instead (a shuffle per element).
//!   4 × 2 accumulators fit the sixteen registers with the chunks they multiply; 4 × 3 spilled
//!   and measured slower.

/// Lanes per accumulator.
const LANES: usize = 8;

/// Dot products of `R` weight rows with `J` activation rows in the order of the module doc.
trait Dots: Copy {
    /// Whether blocks take two activation rows (else one).
    const TWO_TOKENS: bool;

    /// `[q][j] = w[q] · a[j]` over the first `k` values (a multiple of `LANES`).
    fn dots<const R: usize, const J: usize>(
        self,
        w: [&[f32]; R],
        a: [&[f32]; J],
        k: usize,
    ) -> [[f32; J]; R];
}

/// Plain arrays, vectorized as the compiler sees fit.
#[derive(Clone, Copy)]
struct Portable;

impl Dots for Portable {
    // On x86-64 without AVX, 4 × 2 blocks spill the sixteen 128-bit registers (two per
    // accumulator) and measured slower; other architectures were not measured.
    const TWO_TOKENS: bool = false;

    #[inline(always)]
    fn dots<const R: usize, const J: usize>(
        self,
        w: [&[f32]; R],
        a: [&[f32]; J],
        k: usize,
    ) -> [[f32; J]; R] {
        let len = k / LANES * LANES;
        let mut acc = [[[0.0f32; LANES]; J]; R];
        let mut c = 0;
        while c < len {
            let av: [&[f32]; J] = a.map(|s| &s[c..c + LANES]);
            for (accq, wq) in acc.iter_mut().zip(w) {
                let wv = &wq[c..c + LANES];
                for (accj, avj) in accq.iter_mut().zip(av) {
                    for l in 0..LANES {
                        accj[l] += wv[l] * avj[l];
                    }
                }
            }
            c += LANES;
        }
        acc.map(|q| q.map(|v| v.iter().sum()))
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    use super::{Dots, LANES};
    use std::arch::x86_64::{
        _mm256_add_ps, _mm256_loadu_ps, _mm256_mul_ps, _mm256_setzero_ps, _mm256_storeu_ps,
    };

    /// Proof that the CPU has AVX: only `Avx::detect` makes one.
    #[derive(Clone, Copy)]
    pub(super) struct Avx(());

    impl Avx {
        pub(super) fn detect() -> Option<Self> {
            std::arch::is_x86_feature_detected!("avx").then_some(Avx(()))
        }
    }

    impl Dots for Avx {
        const TWO_TOKENS: bool = true;

        #[inline(always)]
        fn dots<const R: usize, const J: usize>(
            self,
            w: [&[f32]; R],
            a: [&[f32]; J],
            k: usize,
        ) -> [[f32; J]; R] {
            // SAFETY: an `Avx` exists only where AVX was detected.
            unsafe { dots(w, a, k) }
        }
    }

    /// `Dots::dots` with one register per accumulator: `vmulps` then `vaddps` round each lane
    /// exactly like the scalar multiply and add (AVX has no FMA; it is a separate feature).
    ///
    /// # Safety
    ///
    /// The CPU must have AVX.
    #[inline]
    #[target_feature(enable = "avx")]
    unsafe fn dots<const R: usize, const J: usize>(
        w: [&[f32]; R],
        a: [&[f32]; J],
        k: usize,
    ) -> [[f32; J]; R] {
        let len = k / LANES * LANES;
        let mut acc = [[_mm256_setzero_ps(); J]; R];
        let mut c = 0;
        while c < len {
            let mut av = [_mm256_setzero_ps(); J];
            for (v, s) in av.iter_mut().zip(a) {
                let s = &s[c..c + LANES];
                // SAFETY: `s` holds the eight floats read (unaligned loads are allowed).
                *v = unsafe { _mm256_loadu_ps(s.as_ptr()) };
            }
            for (accq, wq) in acc.iter_mut().zip(w) {
                let wq = &wq[c..c + LANES];
                // SAFETY: `wq` holds the eight floats read (unaligned loads are allowed).
                let wv = unsafe { _mm256_loadu_ps(wq.as_ptr()) };
                for (accj, &avj) in accq.iter_mut().zip(&av) {
                    *accj = _mm256_add_ps(*accj, _mm256_mul_ps(wv, avj));
                }
            }
            c += LANES;
        }
        let mut out = [[0.0f32; J]; R];
        for (oq, accq) in out.iter_mut().zip(&acc) {
            for (o, &v) in oq.iter_mut().zip(accq) {
                let mut lanes = [0.0f32; LANES];
                // SAFETY: `lanes` has room for the eight floats written.
                unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), v) };
                *o = lanes.iter().sum();
            }
        }
        out
    }
}

/// Writes `out[q * n + j0 + t] = w[q] · act(j0 + t)` for the `J` tokens from `j0`.
#[inline(always)]
fn block<'a, D: Dots, const R: usize, const J: usize, A>(
    d: D,
    w: [&[f32]; R],
    act: &A,
    j0: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
) where
    A: Fn(usize) -> &'a [f32],
{
    let v = d.dots::<R, J>(w, std::array::from_fn(|t| act(j0 + t)), k);
    for (vq, oq) in v.iter().zip(out.chunks_exact_mut(n)) {
        oq[j0..j0 + J].copy_from_slice(vq);
    }
}

/// `out[q * n + j] = w[q] · act(j)` for all `n` activation rows, in blocks of one or two.
#[inline(always)]
fn against_tokens<'a, D: Dots, const R: usize, A>(
    d: D,
    w: [&[f32]; R],
    act: &A,
    n: usize,
    k: usize,
    out: &mut [f32],
) where
    A: Fn(usize) -> &'a [f32],
{
    let mut j = 0;
    if D::TWO_TOKENS {
        while j + 2 <= n {
            block::<D, R, 2, A>(d, w, act, j, n, k, out);
            j += 2;
        }
    }
    while j < n {
        block::<D, R, 1, A>(d, w, act, j, n, k, out);
        j += 1;
    }
}

/// The kernel for one implementation of the dots; `load_row` counts rows from the block's first.
#[inline(always)]
fn kernel<'a, D: Dots, L, A>(
    d: D,
    load_row: &L,
    act: &A,
    n: usize,
    k: usize,
    out: &mut [f32],
    buf: &mut [f32],
) where
    L: Fn(usize, &mut [f32]),
    A: Fn(usize) -> &'a [f32],
{
    let rows = out.len() / n;
    let mut r = 0;
    while r + 4 <= rows {
        for q in 0..4 {
            load_row(r + q, &mut buf[q * k..(q + 1) * k]);
        }
        let w: [&[f32]; 4] = std::array::from_fn(|q| &buf[q * k..(q + 1) * k]);
        against_tokens::<D, 4, A>(d, w, act, n, k, &mut out[r * n..(r + 4) * n]);
        r += 4;
    }
    while r < rows {
        load_row(r, &mut buf[..k]);
        against_tokens::<D, 1, A>(d, [&buf[..k]], act, n, k, &mut out[r * n..(r + 1) * n]);
        r += 1;
    }
}

/// Computes rows `row0 .. row0 + out.len() / n` of `W · A^T` into `out` (`[rows][n]`).
///
/// `load_row(r, buf)` writes weight row `r` (`k` values); `act(j)` is activation row `j < n`;
/// `buf` holds at least `4·k` floats. `k` is a multiple of 8 (the callers' widths are NVFP4
/// multiples of 16): the dots stop at the last whole chunk of 8.
pub(crate) fn rows_times_activations<'a, L, A>(
    load_row: &L,
    act: &A,
    row0: usize,
    n: usize,
    k: usize,
    out: &mut [f32],
    buf: &mut [f32],
) where
    L: Fn(usize, &mut [f32]),
    A: Fn(usize) -> &'a [f32],
{
    if n == 0 {
        return;
    }
    let load = |r: usize, b: &mut [f32]| load_row(row0 + r, b);
    #[cfg(target_arch = "x86_64")]
    if let Some(d) = avx::Avx::detect() {
        return kernel(d, &load, act, n, k, out, buf);
    }
    kernel(Portable, &load, act, n, k, out, buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_naive_product() {
        let (rows, n, k) = (7, 3, 32);
        let w: Vec<f32> = (0..rows * k)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 16.0)
            .collect();
        let a: Vec<f32> = (0..n * k)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 8.0)
            .collect();
        let mut out = vec![0.0f32; (rows - 1) * n];
        let mut buf = vec![0.0f32; 4 * k];
        let load = |r: usize, b: &mut [f32]| b.copy_from_slice(&w[r * k..(r + 1) * k]);
        let act = |j: usize| &a[j * k..(j + 1) * k];
        rows_times_activations(&load, &act, 1, n, k, &mut out, &mut buf);
        for r in 0..rows - 1 {
            for j in 0..n {
                let want: f64 = (0..k)
                    .map(|c| w[(r + 1) * k + c] as f64 * a[j * k + c] as f64)
                    .sum();
                assert!((out[r * n + j] as f64 - want).abs() < 1e-3, "r={r} j={j}");
            }
        }
    }

    /// Deterministic non-zero values of both signs spread over several binades, so that any
    /// change in the order of the roundings shows in the low bits.
    fn values(len: usize, seed: u64) -> Vec<f32> {
        use rand::{rngs::SmallRng, RngCore, SeedableRng};
        let mut rng = SmallRng::seed_from_u64(seed);
        (0..len)
            .map(|_| {
                let x = rng.next_u64();
                let m = 1.0 + (x >> 40) as f32 / (1u64 << 24) as f32;
                let e = ((x >> 8) % 7) as i32 - 3;
                let s = if x & 1 == 0 { 1.0 } else { -1.0 };
                s * m * 2f32.powi(e)
            })
            .collect()
    }

    /// The pre-blocking order, written out: lane `c % 8` accumulates in increasing `c`, then the
    /// lanes are summed by the same `iter().sum()`.
    fn reference_dot(w: &[f32], a: &[f32]) -> f32 {
        let mut acc = [0.0f32; LANES];
        for (c, (x, y)) in w.iter().zip(a).enumerate() {
            acc[c % LANES] += x * y;
        }
        acc.iter().sum()
    }

    #[test]
    fn bitwise_equal_to_lane_order_reference() {
        for k in [16, 64, 2688] {
            for rows in [1, 3, 4, 6, 11] {
                for n in 1..=9 {
                    let row0 = 2;
                    let w = values((row0 + rows) * k, (k * 31 + rows * 7 + n) as u64);
                    let a = values(n * k, (k * 17 + n * 5 + rows) as u64 ^ 0x9E37);
                    let load = |r: usize, b: &mut [f32]| b.copy_from_slice(&w[r * k..(r + 1) * k]);
                    let act = |j: usize| &a[j * k..(j + 1) * k];
                    let want: Vec<u32> = (0..rows * n)
                        .map(|i| {
                            let (r, j) = (row0 + i / n, i % n);
                            reference_dot(&w[r * k..(r + 1) * k], act(j)).to_bits()
                        })
                        .collect();
                    // Dispatched is the AVX implementation where the CPU has AVX.
                    for (v, name) in ["dispatched", "portable"].into_iter().enumerate() {
                        let mut out = vec![f32::NAN; rows * n];
                        let mut buf = vec![f32::NAN; 4 * k];
                        let (o, b) = (&mut out[..], &mut buf[..]);
                        match v {
                            0 => rows_times_activations(&load, &act, row0, n, k, o, b),
                            _ => {
                                let shifted = |r: usize, b: &mut [f32]| load(row0 + r, b);
                                kernel(Portable, &shifted, &act, n, k, o, b)
                            }
                        }
                        let got: Vec<u32> = out.iter().map(|v| v.to_bits()).collect();
                        assert_eq!(got, want, "{name}: k={k} rows={rows} n={n}");
                    }
                }
            }
        }
    }
}
