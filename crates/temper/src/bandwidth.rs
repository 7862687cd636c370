//! The host's memory read bandwidth, next to which decode speed means something: a batch-1
//! decode step reads every weight once, so its ceiling is bandwidth / weight bytes.

use std::time::Instant;

use rayon::prelude::*;

/// Bytes per second the engine's threads read from a buffer far larger than the caches (256
/// MiB, summed as u64 words by rayon's threads), best of five passes.
pub fn read_bytes_per_s() -> f64 {
    const BYTES: usize = 256 << 20;
    let words = vec![1u64; BYTES / 8];
    let mut best = f64::INFINITY;
    for _ in 0..5 {
        let t = Instant::now();
        let sum: u64 = words
            .par_chunks(1 << 16)
            .map(|c| c.iter().fold(0u64, |a, &w| a.wrapping_add(w)))
            .sum();
        std::hint::black_box(sum);
        best = best.min(t.elapsed().as_secs_f64());
    }
    BYTES as f64 / best
}
