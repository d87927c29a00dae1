//! This machine's memory, for the floors of the CPU backends: the read+write bandwidth of a
//! parallel copy, which `demo` and `bench` divide the expert bytes a batch reads by (DESIGN 5's
//! memory floor measured on the host instead of the GPU).

use rayon::prelude::*;
use std::time::Instant;

/// Read+write bandwidth of a parallel 256 MiB copy over rayon's threads, best of four, in
/// bytes/s (the buffers are far larger than the caches, as the experts' weights are).
pub(crate) fn copy_bandwidth() -> f64 {
    const N: usize = 256 << 20;
    let src = vec![1u8; N];
    let mut dst = vec![0u8; N];
    let chunk = (N / rayon::current_num_threads().max(1) / 4).max(1);
    let mut best = f64::MAX;
    for _ in 0..4 {
        let t = Instant::now();
        dst.par_chunks_mut(chunk)
            .zip(src.par_chunks(chunk))
            .for_each(|(d, s)| d.copy_from_slice(s));
        best = best.min(t.elapsed().as_secs_f64());
    }
    std::hint::black_box(&dst);
    2.0 * N as f64 / best
}
