//! A team of threads that spin between the short parallel regions of a forward over a few rows.
//!
//! A decode step streams every weight once and runs ~6 parallel regions a layer, each tens of
//! microseconds long. On rayon's pool the idle worker yields, then sleeps, between them and is
//! woken through a futex: profiled at ~5% of a 1B model's decode at one stream (~2,800
//! `sched_yield` and ~84 futex calls a token). The team's helpers spin on the next region's
//! number instead, as ggml's threads do between operations, and park only after [`SPIN`]
//! without work (an idle server costs no CPU). Each thread takes one contiguous share of a
//! weight (`kernels::matmul_slices`). Measured on AVX2 against the pool (alternated runs):
//! one stream 0-4% faster at 1B-1.7B; beside a training job at nice 19, one stream went from
//! 0.65x to 0.91-0.96x of its speed alone (the spinning threads keep the cores, as
//! `--train-nice` means: the job takes them while nothing decodes); at nice 0, an even share
//! either way (0.47-0.59x against 0.51-0.62x).
//!
//! One forward leads the team at a time; another (a second model's, a long prefill's, the
//! trainer's) runs on rayon as before, with the same tasks and so the same bits, and so does a
//! region inside a region.

use std::cell::{Cell, UnsafeCell};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::OnceLock;
use std::thread::Thread;
use std::time::{Duration, Instant};

use rayon::prelude::*;

/// A forward over at most this many rows runs its parallel regions on the team; more rows make
/// regions long enough that rayon's wake-ups cost nothing next to them (and rayon's joins keep
/// several products in flight at once).
pub(crate) const MAX_ROWS: usize = 16;

/// How long a helper spins for the next region before it parks. Covers the gaps inside a
/// decode step (microseconds) and the engine's work between steps (sampling, streaming).
const SPIN: Duration = Duration::from_micros(200);

thread_local! {
    /// This thread leads the team (inside [`lead`]) and is not inside one of its regions.
    static LEADS: Cell<bool> = const { Cell::new(false) };
}

/// `f()`, a forward over `rows` rows: on the calling thread leading the team when the rows are
/// few and the team is free, else inside rayon's pool (each parallel loop is then split among
/// threads already awake, not handed to the pool from outside and waited for).
pub(crate) fn lead<R: Send>(rows: usize, f: impl FnOnce() -> R + Send) -> R {
    let threads = rayon::current_num_threads();
    match team(threads) {
        Some(team) if rows <= MAX_ROWS && team.claim() => {
            let _lease = Lease(team);
            LEADS.set(true);
            f()
        }
        _ => rayon::scope(|_| f()),
    }
}

/// Runs `task(i)` for every `i` in `0..tasks`, each once: on the team when this thread leads
/// it, else on rayon's pool. Which threads run which task never changes a task's numbers.
pub(crate) fn for_each(tasks: usize, task: &(dyn Fn(usize) + Sync)) {
    if tasks <= 1 {
        (0..tasks).for_each(task);
    } else if let Some(team) = leading() {
        LEADS.set(false);
        let _back = Back;
        team.run(tasks, task);
    } else {
        (0..tasks).into_par_iter().for_each(task);
    }
}

/// `f(i, chunk)` for chunk `i` of `data` cut in `chunk_len`s (the last may be shorter), each
/// once, as [`for_each`] runs its tasks.
pub(crate) fn for_each_chunk<T: Send>(
    data: &mut [T],
    chunk_len: usize,
    f: &(dyn Fn(usize, &mut [T]) + Sync),
) {
    let len = data.len();
    let base = SendPtr(data.as_mut_ptr());
    for_each(len.div_ceil(chunk_len.max(1)), &|i| {
        let start = i * chunk_len;
        let end = (start + chunk_len).min(len);
        // SAFETY: each task `i` runs once and takes the range `start..end` of `data`, disjoint
        // from every other task's, while `data` stays borrowed for the call.
        let chunk = unsafe { std::slice::from_raw_parts_mut(base.get().add(start), end - start) };
        f(i, chunk)
    });
}

/// A pointer into a slice whose disjoint parts the tasks write.
struct SendPtr<T>(*mut T);

impl<T> SendPtr<T> {
    fn get(&self) -> *mut T {
        self.0
    }
}

// SAFETY: used only by `for_each_chunk`, whose tasks touch disjoint parts of a `Send` slice.
unsafe impl<T: Send> Sync for SendPtr<T> {}

/// `(a(), b())`: one after the other when this thread leads the team (a join would wake one of
/// rayon's sleeping workers for a second product beside the team's), else [`rayon::join`].
pub(crate) fn join<A: Send, B: Send>(
    a: impl FnOnce() -> A + Send,
    b: impl FnOnce() -> B + Send,
) -> (A, B) {
    if leads() {
        (a(), b())
    } else {
        rayon::join(a, b)
    }
}

/// This thread leads the team (and is not inside one of its regions).
pub(crate) fn leads() -> bool {
    leading().is_some()
}

fn leading() -> Option<&'static Team> {
    LEADS.get().then(|| TEAM.get().copied().flatten()).flatten()
}

static TEAM: OnceLock<Option<&'static Team>> = OnceLock::new();

/// The team, sized as rayon's global pool (serving's threads), for a caller in a pool of
/// `threads` threads: a pool of another size (the trainer's) runs on rayon.
fn team(threads: usize) -> Option<&'static Team> {
    let team = *TEAM.get_or_init(|| {
        // The global pool's size, asked from a thread outside every pool.
        let global = std::thread::scope(|s| s.spawn(rayon::current_num_threads).join());
        let global = global.expect("asking the pool's size");
        (global > 1).then(|| Team::start(global - 1))
    });
    team.filter(|t| t.helpers.len() + 1 == threads)
}

/// The team held for one [`lead`]: released (and the thread no longer leading) on return or
/// unwind.
struct Lease(&'static Team);

impl Drop for Lease {
    fn drop(&mut self) {
        LEADS.set(false);
        self.0.busy.store(false, SeqCst);
    }
}

/// The leader back from a region (on return or unwind).
struct Back;

impl Drop for Back {
    fn drop(&mut self) {
        LEADS.set(true);
    }
}

struct Team {
    /// Set while a forward leads the team.
    busy: AtomicBool,
    /// Bumped as each region starts.
    region: AtomicU64,
    /// The current region's tasks may be taken while set.
    live: AtomicBool,
    next: AtomicUsize,
    tasks: AtomicUsize,
    /// Helpers inside a region (between seeing it and leaving it).
    active: AtomicUsize,
    /// A helper's task panicked in the current region.
    panicked: AtomicBool,
    /// The region's work, written by its caller only while no helper is active.
    work: UnsafeCell<Option<&'static (dyn Fn(usize) + Sync)>>,
    helpers: Vec<Helper>,
}

struct Helper {
    thread: Thread,
    parked: AtomicBool,
}

// SAFETY: `work` is written only by the leader while `live` is clear, and read only by a helper
// counted in `active` that saw `live` set.
unsafe impl Sync for Team {}

impl Team {
    fn start(helpers: usize) -> &'static Team {
        // The helpers' handles are known only once they run; they wait for `region` 1.
        let team: &'static OnceLock<Team> = Box::leak(Box::new(OnceLock::new()));
        let threads: Vec<Thread> = (0..helpers)
            .map(|i| {
                std::thread::Builder::new()
                    .name(format!("temper-team-{i}"))
                    .spawn(move || {
                        let team = loop {
                            match team.get() {
                                Some(t) => break t,
                                None => std::thread::park(),
                            }
                        };
                        team.help(i)
                    })
                    .expect("spawning a team thread")
                    .thread()
                    .clone()
            })
            .collect();
        let made = team.get_or_init(|| Team {
            busy: AtomicBool::new(false),
            region: AtomicU64::new(0),
            live: AtomicBool::new(false),
            next: AtomicUsize::new(0),
            tasks: AtomicUsize::new(0),
            active: AtomicUsize::new(0),
            panicked: AtomicBool::new(false),
            work: UnsafeCell::new(None),
            helpers: threads
                .into_iter()
                .map(|thread| Helper {
                    thread,
                    parked: AtomicBool::new(false),
                })
                .collect(),
        });
        for h in &made.helpers {
            h.thread.unpark();
        }
        made
    }

    fn claim(&self) -> bool {
        self.busy
            .compare_exchange(false, true, SeqCst, SeqCst)
            .is_ok()
    }

    /// One region: publishes `task`, takes tasks beside the helpers, and returns once every
    /// task has run and no helper can still reach `task`.
    fn run(&self, tasks: usize, task: &(dyn Fn(usize) + Sync)) {
        // SAFETY: `task` outlives the region: `Region`'s drop clears `live` and waits until no
        // helper is active before this function returns (or unwinds).
        let work: &'static (dyn Fn(usize) + Sync) = unsafe { std::mem::transmute(task) };
        // SAFETY: this thread leads (`busy`) and `live` is clear: a helper reads `work` only after it sees
        // `live` set, which is stored below.
        unsafe { *self.work.get() = Some(work) };
        self.tasks.store(tasks, SeqCst);
        self.next.store(0, SeqCst);
        self.panicked.store(false, SeqCst);
        self.live.store(true, SeqCst);
        self.region.fetch_add(1, SeqCst);
        let region = Region(self);
        for h in &self.helpers {
            if h.parked.load(SeqCst) {
                h.thread.unpark();
            }
        }
        self.take_tasks(task);
        drop(region);
        if self.panicked.load(SeqCst) {
            panic!("a task of the thread team panicked");
        }
    }

    fn take_tasks(&self, task: &(dyn Fn(usize) + Sync)) {
        let tasks = self.tasks.load(SeqCst);
        loop {
            let i = self.next.fetch_add(1, SeqCst);
            if i >= tasks {
                break;
            }
            task(i);
        }
    }

    /// Helper `me`'s loop: waits for each region (spinning, then parked) and takes its tasks.
    fn help(&self, me: usize) -> ! {
        let helper = &self.helpers[me];
        let mut seen = self.region.load(SeqCst);
        loop {
            let started = Instant::now();
            let mut spins = 0u32;
            while self.region.load(SeqCst) == seen {
                pause(started, HELPER_YIELD_AFTER);
                spins = spins.wrapping_add(1);
                if spins.is_multiple_of(256) && started.elapsed() > SPIN {
                    helper.parked.store(true, SeqCst);
                    // A caller bumps `region` before it reads `parked`: one of the two sees
                    // the other's store, and `unpark` before `park` is not lost.
                    if self.region.load(SeqCst) == seen {
                        std::thread::park();
                    }
                    helper.parked.store(false, SeqCst);
                }
            }
            seen = self.region.load(SeqCst);
            self.active.fetch_add(1, SeqCst);
            if self.live.load(SeqCst) {
                // SAFETY: `live` was seen set after this helper counted itself active, so the
                // region's caller has not returned and `work` is its task.
                if let Some(work) = unsafe { *self.work.get() } {
                    if catch_unwind(AssertUnwindSafe(|| self.take_tasks(work))).is_err() {
                        self.panicked.store(true, SeqCst);
                    }
                }
            }
            self.active.fetch_sub(1, SeqCst);
        }
    }
}

/// One turn of a wait begun at `started`: a spin, then, past `yield_after`, a yield, so that a
/// thread preempted by other work on a busy machine (a trainer at `--train-nice 0`) gets the
/// core back.
fn pause(started: Instant, yield_after: Duration) {
    if started.elapsed() < yield_after {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// The leader waits for helpers finishing their last task: longer than a task's usual tail,
/// the helper was likely preempted mid-task.
const LEADER_YIELD_AFTER: Duration = Duration::from_micros(20);

/// A helper waits for the next region: a decode step's gaps are shorter than this (yielding
/// within them handed a trainer at nice 19 the cores mid-step: decode beside a job measured
/// 0.84-0.94x with 20-50 µs here, 0.91-0.96x with 100), the engine's between steps may be
/// longer.
const HELPER_YIELD_AFTER: Duration = Duration::from_micros(100);

/// The end of a region, on return or unwind: no new task starts, and the caller waits for the
/// helpers still running one.
struct Region<'a>(&'a Team);

impl Drop for Region<'_> {
    fn drop(&mut self) {
        let team = self.0;
        team.live.store(false, SeqCst);
        // A task of this region may still run on a helper; stop others from starting.
        team.next.store(usize::MAX / 2, SeqCst);
        let started = Instant::now();
        while team.active.load(SeqCst) != 0 {
            pause(started, LEADER_YIELD_AFTER);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicU32;

    fn counted(tasks: usize) {
        let counts: Vec<AtomicU32> = (0..tasks).map(|_| AtomicU32::new(0)).collect();
        for_each(tasks, &|i| {
            counts[i].fetch_add(1, SeqCst);
        });
        assert!(counts.iter().all(|c| c.load(SeqCst) == 1));
    }

    #[test]
    fn every_task_runs_once_over_many_regions_led_or_not() {
        for rows in [1, MAX_ROWS + 1] {
            lead(rows, || {
                for tasks in [0, 1, 2, 3, 8, 100] {
                    (0..200).for_each(|_| counted(tasks));
                }
            });
        }
    }

    #[test]
    fn every_chunk_is_handed_out_once_led_or_not() {
        for rows in [1, MAX_ROWS + 1] {
            lead(rows, || {
                for (len, chunk) in [(0, 3), (1, 3), (10, 3), (12, 4), (1000, 7)] {
                    let mut data = vec![0usize; len];
                    for_each_chunk(&mut data, chunk, &|i, c| {
                        assert!(c.len() == chunk || (i + 1) * chunk >= len);
                        c.iter_mut().for_each(|v| *v += i + 1);
                    });
                    assert!(data.iter().enumerate().all(|(at, &v)| v == at / chunk + 1));
                }
            });
        }
    }

    #[test]
    fn a_region_inside_a_task_runs_on_rayon() {
        lead(1, || {
            for_each(4, &|_| counted(6));
        });
    }

    #[test]
    fn two_threads_leading_at_once_each_run_all_their_tasks() {
        let total = AtomicU32::new(0);
        std::thread::scope(|s| {
            for tasks in [7, 5] {
                let total = &total;
                s.spawn(move || {
                    for _ in 0..300 {
                        lead(1, || for_each(tasks, &|_| _ = total.fetch_add(1, SeqCst)));
                    }
                });
            }
        });
        assert_eq!(total.load(SeqCst), 300 * 12);
    }

    #[test]
    fn a_panicking_task_reaches_the_caller_and_frees_the_team() {
        for _ in 0..20 {
            let outcome = catch_unwind(|| lead(1, || for_each(4, &|i| assert_ne!(i, 3))));
            assert!(outcome.is_err());
            assert!(!LEADS.get());
            lead(1, || counted(4));
        }
    }
}
