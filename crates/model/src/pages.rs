//! Weights backed by transparent huge pages.
//!
//! The kernels stream every weight once per step, the LM head's 168 MB and the layers' 67 MB on
//! the default model. With 4 KiB pages a decode step takes a TLB miss every 4 KiB of them. On
//! one host (AMD EPYC, avx2 avx512f avx512_vnni avx512_bf16; the x86-64-v3 build with
//! `TEMPER_ISA=avx2`), the two builds alternated five times, one decoding stream made 112-135
//! tok/s with the weights collapsed as here against 93-122 without (`temper bench`), and the
//! one-row LM head took 0.76-0.80x the time (`kernel_throughput`, two threads). Hosts set to
//! `madvise` (a common default) give huge pages only to memory that asks.

/// Bytes per transparent huge page on x86-64 (and the usual size elsewhere).
const HUGE_PAGE: usize = 2 << 20;

/// Asks the kernel to back the huge pages that `bytes` overlaps with huge pages now
/// (`MADV_COLLAPSE`, Linux 6.1+): a best effort, an error only leaves ordinary pages. The pages
/// at either end may hold neighbouring allocations too; collapsing them changes how they are
/// backed, never what they hold. Asked after the weight is written (a copy in the kernel, the
/// default model loaded in ~0.6 s instead of ~0.5 s): advising a buffer before its first touch
/// instead made the page faults compact memory, 0.8-1.1 s.
pub(crate) fn collapse_into_huge_pages(bytes: &[u8]) {
    if bytes.is_empty() {
        return;
    }
    let start = bytes.as_ptr() as usize / HUGE_PAGE * HUGE_PAGE;
    let end = (bytes.as_ptr() as usize + bytes.len()).next_multiple_of(HUGE_PAGE);
    #[cfg(target_os = "linux")]
    for page in (start..end).step_by(HUGE_PAGE) {
        // One page per call: one that lies partly outside the mapping (the first or last) fails
        // alone.
        // SAFETY: advice about how mapped memory is backed; it never changes its contents, and
        // an address outside any mapping only makes the call fail.
        unsafe {
            libc::madvise(page as *mut libc::c_void, HUGE_PAGE, libc::MADV_COLLAPSE);
        }
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (start, end);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn collapsed_buffers_keep_their_bytes() {
        for len in [0, 1, HUGE_PAGE - 1, 3 * HUGE_PAGE + 5] {
            let b: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            collapse_into_huge_pages(&b);
            assert!(b.iter().enumerate().all(|(i, &x)| x == (i % 251) as u8));
        }
    }
}
