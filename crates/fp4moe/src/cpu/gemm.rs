//! The CPU micro-kernel: `out[r, j] = Σ_c W[r, c] · a_j[c]` for a block of weight rows against a
//! set of activation rows, with `W` rows produced on the fly (NVFP4 dequantized into a small
//! per-thread buffer, never a full copy). Four weight rows share each activation load; each dot
//! uses eight independent f32 accumulators so the compiler can vectorize it.

/// Lanes per accumulator.
const LANES: usize = 8;

/// Four dot products of the rows of `w` (`[4, k]`) with `a` (`k`).
#[inline(always)]
fn dot4(w: &[f32], k: usize, a: &[f32]) -> [f32; 4] {
    let (w0, rest) = w.split_at(k);
    let (w1, rest) = rest.split_at(k);
    let (w2, w3) = rest.split_at(k);
    let mut acc = [[0.0f32; LANES]; 4];
    for ((((av, x0), x1), x2), x3) in a
        .chunks_exact(LANES)
        .zip(w0.chunks_exact(LANES))
        .zip(w1.chunks_exact(LANES))
        .zip(w2.chunks_exact(LANES))
        .zip(w3.chunks_exact(LANES))
    {
        for l in 0..LANES {
            acc[0][l] += x0[l] * av[l];
            acc[1][l] += x1[l] * av[l];
            acc[2][l] += x2[l] * av[l];
            acc[3][l] += x3[l] * av[l];
        }
    }
    acc.map(|v| v.iter().sum())
}

#[inline(always)]
fn dot1(w: &[f32], a: &[f32]) -> f32 {
    let mut acc = [0.0f32; LANES];
    for (av, x) in a.chunks_exact(LANES).zip(w.chunks_exact(LANES)) {
        for l in 0..LANES {
            acc[l] += x[l] * av[l];
        }
    }
    acc.iter().sum()
}

/// Computes rows `row0 .. row0 + out.len() / n` of `W · A^T` into `out` (`[rows][n]`).
///
/// `load_row(r, buf)` writes weight row `r` (`k` values); `act(j)` is activation row `j < n`;
/// `buf` holds at least `4·k` floats.
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
    let rows = out.len() / n;
    let mut r = 0;
    while r + 4 <= rows {
        for q in 0..4 {
            load_row(row0 + r + q, &mut buf[q * k..(q + 1) * k]);
        }
        for j in 0..n {
            let d = dot4(&buf[..4 * k], k, act(j));
            for (q, v) in d.into_iter().enumerate() {
                out[(r + q) * n + j] = v;
            }
        }
        r += 4;
    }
    while r < rows {
        load_row(row0 + r, &mut buf[..k]);
        for j in 0..n {
            out[r * n + j] = dot1(&buf[..k], act(j));
        }
        r += 1;
    }
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
}
