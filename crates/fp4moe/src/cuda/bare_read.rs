//! A timing yardstick for `fp4moe bench --bare-reads`, not part of the layer: `bare_read.cu`
//! reads every byte of the routed experts' weights (w13's and w2's packed data and scales) once
//! and computes nothing. Run after the layer's own routing it is the least a layer that keeps
//! this routing and reads each weight once can take; run alone (over the grouping the
//! workspace's last forward left), the least the touched weights' bytes take in one launch.
//! Against the memory floor (DESIGN 5: the same bytes at the measured copy bandwidth) the
//! second says what one kernel's ramp and tail add, the first what routing adds to that.

use super::{ptr, CudaLayer, CudaWorkspace};
use crate::error::Result;
use cudarc::driver::{CudaSlice, LaunchConfig};

/// What a bare-read forward runs in place of the layer ([`CudaLayer::set_bare_read`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BareRead {
    /// The read alone, over the grouping the workspace's last forward left.
    Alone,
    /// The layer's routing on the path it takes for the batch (never the one-token layer,
    /// whose routing is inside its one launch), then the read.
    AfterRouting,
    /// The layer's routing, then w13's bytes, then w2's in a second launch that waits for the
    /// first to end, as GEMM2 waits for GEMM1.
    AfterRoutingTwoReads,
}

impl BareRead {
    pub const ALL: [BareRead; 3] = [
        BareRead::Alone,
        BareRead::AfterRouting,
        BareRead::AfterRoutingTwoReads,
    ];

    /// The mode as `fp4moe bench` prints it.
    pub fn name(self) -> &'static str {
        match self {
            BareRead::Alone => "alone",
            BareRead::AfterRouting => "after routing",
            BareRead::AfterRoutingTwoReads => "after routing, w13 then w2",
        }
    }

    /// The mode's key in `fp4moe bench --json`'s `bare_read_us`.
    pub fn key(self) -> &'static str {
        match self {
            BareRead::Alone => "alone",
            BareRead::AfterRouting => "after_routing",
            BareRead::AfterRoutingTwoReads => "after_routing_two_reads",
        }
    }
}

/// `bare_read.cu`'s BR_UNROLL, BR_THREADS and BR_BLOCKS: a chunk is BR_UNROLL·BR_THREADS
/// 16-byte vectors; BR_BLOCKS blocks per SM (2048 threads at the kernel's 32 registers).
const BR_UNROLL: usize = 8;
const BR_THREADS: usize = 256;
const BR_BLOCKS: usize = 8;

/// Expert e's region of `bytes` (all experts' bytes of one kind in `experts` equal slices:
/// `pack::pack_nvfp4` gives each expert rg_n·kg·512 data and rg_n·kg·64 scale bytes, multiples
/// of 16) in 16-byte vectors, and its chunks.
fn region(bytes: usize, experts: usize) -> (u64, i32) {
    debug_assert_eq!(
        bytes % (experts.max(1) * 16),
        0,
        "per-expert regions of whole vectors"
    );
    let len = bytes / experts.max(1) / 16;
    (len as u64, len.div_ceil(BR_UNROLL * BR_THREADS) as i32)
}

impl CudaLayer {
    /// The four regions the kernel reads, in its order (w13 data, w13 scales, w2 data, w2
    /// scales): each one's base pointer, per-expert length in 16-byte vectors and chunks.
    fn bare_read_regions(&self) -> [(u64, u64, i32); 4] {
        let (st, e) = (&self.dev.stream, self.spec.shape.experts);
        let slices = [
            &self.w13.data,
            &self.w13.scales,
            &self.w2.data,
            &self.w2.scales,
        ];
        slices.map(|s| {
            let (len, chunks) = region(s.len(), e);
            (ptr(s, st), len, chunks)
        })
    }

    /// Makes later forwards run the yardstick `mode` instead of the layer (`None`: the layer).
    /// A timing diagnostic: a bare-read forward leaves the output unwritten. Each call zeroes
    /// the counts [`CudaLayer::bare_read_vectors`] reads (one buffer per layer, so graphs
    /// captured under an earlier mode keep a valid one).
    pub fn set_bare_read(&mut self, mode: Option<BareRead>) -> Result<()> {
        let Some(mode) = mode else {
            self.bare_read = None;
            return Ok(());
        };
        let st = &self.dev.stream;
        match &mut self.bare_read_sink {
            Some(sink) => st.memset_zeros(sink),
            None => st
                .alloc_zeros::<u32>(self.dev.sms * BR_BLOCKS + 1)
                .map(|sink| self.bare_read_sink = Some(sink)),
        }
        .map_err(super::driver_err("bare-read counts"))?;
        self.bare_read = Some(mode);
        Ok(())
    }

    /// The 16-byte vectors the yardstick's launches read since [`CudaLayer::set_bare_read`],
    /// and the vectors one read of the active experts of `ws`'s last grouping covers
    /// (synchronizing). `None` before the first `set_bare_read`.
    pub fn bare_read_vectors(&self, ws: &CudaWorkspace) -> Result<Option<(u64, u64)>> {
        let Some(sink) = &self.bare_read_sink else {
            return Ok(None);
        };
        let st = &self.dev.stream;
        let counts = st
            .clone_dtoh(sink)
            .map_err(super::driver_err("bare-read counts"))?;
        let read = counts[..counts.len() - 1]
            .iter()
            .map(|&c| u64::from(c))
            .sum();
        let active = ws.grouping(st)?.active.len() as u64;
        let per: u64 = self.bare_read_regions().iter().map(|r| r.1).sum();
        Ok(Some((read, active * per)))
    }

    pub(super) fn bare_read_device(
        &self,
        ws: &mut CudaWorkspace,
        logits: Option<&CudaSlice<f32>>,
        mode: BareRead,
    ) -> Result<()> {
        let Some(sink) = &self.bare_read_sink else {
            return Err(crate::error::Error::arg(
                "bare_read",
                "set_bare_read allocates the yardstick's counts before it runs",
            ));
        };
        if mode != BareRead::Alone {
            self.route_and_group(ws, logits, self.route_path_for(ws.tokens))?;
        }
        if mode == BareRead::AfterRoutingTwoReads {
            self.bare_read_launch(ws, sink, [true, false])?;
            self.bare_read_launch(ws, sink, [false, true])
        } else {
            self.bare_read_launch(ws, sink, [true, true])
        }
    }

    /// One `bare_read` launch over the active experts' w13 bytes, w2 bytes or both (`which`).
    fn bare_read_launch(
        &self,
        ws: &CudaWorkspace,
        sink: &CudaSlice<u32>,
        which: [bool; 2],
    ) -> Result<()> {
        let st = &self.dev.stream;
        let regions = self.bare_read_regions();
        let bases = regions.map(|r| r.0);
        let lens = regions.map(|r| r.1);
        // Regions 0-1 are w13's, 2-3 w2's: the projection not read gets no chunks.
        let mut chunks = regions.map(|r| r.2);
        for (r, c) in chunks.iter_mut().enumerate() {
            if !which[r / 2] {
                *c = 0;
            }
        }
        let (active, num_active, sink) =
            (ptr(&ws.active, st), ptr(&ws.num_active, st), ptr(sink, st));
        let cfg = LaunchConfig {
            grid_dim: ((self.dev.sms * BR_BLOCKS) as u32, 1, 1),
            block_dim: (BR_THREADS as u32, 1, 1),
            shared_mem_bytes: 0,
        };
        // `bare_read(4 x const uint4*, 4 x unsigned long long, 4 x int, const int*, const int*, unsigned*)`.
        self.launch("bare_read", cfg, |b| {
            for base in &bases {
                b.arg(base);
            }
            for len in &lens {
                b.arg(len);
            }
            for c in &chunks {
                b.arg(c);
            }
            b.arg(&active).arg(&num_active).arg(&sink);
        })
    }
}

#[cfg(test)]
mod tests {
    use super::super::compile::kernel_define;
    use super::*;

    #[test]
    fn constants_match_the_kernel() {
        assert_eq!(kernel_define("bare_read.cu", "BR_UNROLL"), BR_UNROLL);
        assert_eq!(kernel_define("bare_read.cu", "BR_THREADS"), BR_THREADS);
        assert_eq!(kernel_define("bare_read.cu", "BR_BLOCKS"), BR_BLOCKS);
    }

    #[test]
    fn regions_cover_each_expert_in_whole_chunks() {
        // Nemotron-3 Nano's w13 data as pack::pack_nvfp4 lays it out: 128 experts x 116 row
        // groups x 42 k groups x 512 bytes.
        let bytes = 128 * 116 * 42 * 512;
        let (len, chunks) = region(bytes, 128);
        assert_eq!(len as usize * 16 * 128, bytes);
        let span = (BR_UNROLL * BR_THREADS) as u64;
        assert!(chunks as u64 * span >= len && (chunks as u64 - 1) * span < len);
        assert_eq!(region(0, 128), (0, 0));
    }
}
