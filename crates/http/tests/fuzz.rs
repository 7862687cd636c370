//! Property/fuzz tests of the server's two untrusted inputs: request bodies (`fuzz/requests.rs`)
//! and GGUF files (`fuzz/gguf.rs`). Each runs seeded cases for `TEMPER_FUZZ_SECS` seconds
//! (default 3) from `TEMPER_FUZZ_SEED` (a fixed default, so a plain run is repeatable);
//! `make fuzz` runs them for minutes. A failure names the case's seed and the command that
//! replays it alone.
//!
//! The global allocator refuses any single allocation above [`ALLOCATION_LIMIT`]: an input whose
//! length field says 2^60 must be rejected before anything is sized by it.

mod common;
#[path = "fuzz/gguf.rs"]
mod gguf;
#[path = "fuzz/requests.rs"]
mod requests;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Far above what the tiny model and any request to it need (the largest is a few MiB), far
/// below what a length field taken at its word asks for.
const ALLOCATION_LIMIT: usize = 256 << 20;

/// The seed of the case running when an allocation was refused (the process then aborts, so
/// the allocator prints it).
static CURRENT_SEED: AtomicU64 = AtomicU64::new(0);

struct LimitedAllocator;

unsafe impl GlobalAlloc for LimitedAllocator {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if !allowed(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc(layout)
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if !allowed(layout.size()) {
            return std::ptr::null_mut();
        }
        System.alloc_zeroed(layout)
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if !allowed(new_size) {
            return std::ptr::null_mut();
        }
        System.realloc(ptr, layout, new_size)
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        System.dealloc(ptr, layout)
    }
}

/// `eprintln!` writes to the unbuffered stderr without allocating.
fn allowed(size: usize) -> bool {
    if size <= ALLOCATION_LIMIT {
        return true;
    }
    eprintln!(
        "fuzz: refused an allocation of {size} bytes in the case of seed {}",
        CURRENT_SEED.load(Ordering::Relaxed)
    );
    false
}

#[global_allocator]
static ALLOCATOR: LimitedAllocator = LimitedAllocator;

/// SplitMix64: tiny, seedable, and the same sequence on every toolchain and crate version.
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`; `n > 0`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    pub fn one_in(&mut self, n: usize) -> bool {
        self.below(n) == 0
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// The case seeds of one fuzz test: `TEMPER_FUZZ_SEED` and its successors until
/// `TEMPER_FUZZ_SECS` have passed (always at least one case).
pub struct Campaign {
    test: &'static str,
    first: u64,
    next: u64,
    budget: Duration,
    start: Instant,
}

impl Campaign {
    pub fn new(test: &'static str, default_seed: u64) -> Campaign {
        let env = |key: &str| std::env::var(key).ok().filter(|v| !v.is_empty());
        let first = env("TEMPER_FUZZ_SEED").map_or(default_seed, |s| {
            s.parse().expect("TEMPER_FUZZ_SEED is an unsigned integer")
        });
        let secs: f64 = env("TEMPER_FUZZ_SECS").map_or(3.0, |s| {
            s.parse().expect("TEMPER_FUZZ_SECS is a number of seconds")
        });
        Campaign {
            test,
            first,
            next: first,
            budget: Duration::from_secs_f64(secs),
            start: Instant::now(),
        }
    }

    /// Panics with the seed and the command that replays this case alone.
    pub fn fail(&self, seed: u64, what: &str) -> ! {
        panic!(
            "{}: the case of seed {seed} failed: {what}\nreplay it: TEMPER_FUZZ_SEED={seed} \
             TEMPER_FUZZ_SECS=0 cargo test --release -p temper-http --test fuzz {} -- --nocapture",
            self.test, self.test
        )
    }
}

impl Iterator for Campaign {
    type Item = u64;

    fn next(&mut self) -> Option<u64> {
        if self.next != self.first && self.start.elapsed() >= self.budget {
            println!(
                "{}: {} cases (seeds {}..{}) in {:.1} s",
                self.test,
                self.next.wrapping_sub(self.first),
                self.first,
                self.next,
                self.start.elapsed().as_secs_f64()
            );
            return None;
        }
        let seed = self.next;
        self.next = self.next.wrapping_add(1);
        CURRENT_SEED.store(seed, Ordering::Relaxed);
        Some(seed)
    }
}
