//! The trainer's own threads. The model's kernels run on whichever rayon pool calls them: on the
//! global pool (the serving engine's) a training job's matmuls queue beside decoding's, and a
//! decode step waits behind whole trainer kernels. A job therefore runs on a pool of its own
//! whose threads the OS schedules at a lower priority (a higher nice value), so the trainer
//! takes the cores serving leaves idle and yields them while a request decodes.

use std::num::NonZeroUsize;

/// The default `nice` increment of the trainer's threads (docs/cli.md: measured
/// against decode speed while a job runs).
pub const DEFAULT_TRAIN_NICE: u8 = 19;

/// The highest nice value Linux has (the lowest priority).
const MAX_NICE: i32 = 19;

/// How many threads train, and how much lower their priority is than the server's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TrainerThreads {
    pub threads: NonZeroUsize,
    /// Added to the nice value of the thread that builds the pool (capped at 19); 0 keeps the
    /// server's priority. Linux only: elsewhere the threads keep their priority.
    pub nice: u8,
}

impl Default for TrainerThreads {
    /// One thread per core, at the lowest priority.
    fn default() -> Self {
        TrainerThreads {
            threads: std::thread::available_parallelism().unwrap_or(NonZeroUsize::MIN),
            nice: DEFAULT_TRAIN_NICE,
        }
    }
}

/// A rayon pool of [`TrainerThreads`] threads named `temper-train-<i>`; [`TrainerPool::install`]
/// runs a job's kernels on them.
pub struct TrainerPool {
    pool: rayon::ThreadPool,
    nice: i32,
}

impl TrainerPool {
    /// Starts the threads and lowers their priority; the error says which step failed.
    pub fn new(config: TrainerThreads) -> Result<TrainerPool, String> {
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.threads.get())
            .thread_name(|i| format!("temper-train-{i}"))
            .build()
            .map_err(|e| format!("starting {} trainer threads: {e}", config.threads))?;
        let nice = (current_nice()? + i32::from(config.nice)).min(MAX_NICE);
        // Every thread of the pool sets its own priority (Linux's nice is per thread).
        for set in pool.broadcast(|_| set_current_nice(nice)) {
            set.map_err(|e| format!("lowering the trainer threads' priority to nice {nice}: {e}"))?;
        }
        Ok(TrainerPool { pool, nice })
    }

    /// Runs `f` on the pool: the kernels it calls split their work over the pool's threads.
    pub fn install<R: Send>(&self, f: impl FnOnce() -> R + Send) -> R {
        self.pool.install(f)
    }

    pub fn threads(&self) -> usize {
        self.pool.current_num_threads()
    }

    /// The nice value of the pool's threads.
    pub fn nice(&self) -> i32 {
        self.nice
    }
}

/// The calling thread's nice value (on Linux, `PRIO_PROCESS` with id 0 is the calling thread).
#[cfg(target_os = "linux")]
fn current_nice() -> Result<i32, String> {
    // -1 is both a valid nice value and the error return: errno tells them apart.
    // SAFETY: errno is thread-local; getpriority reads only.
    let nice = unsafe {
        *libc::__errno_location() = 0;
        libc::getpriority(libc::PRIO_PROCESS, 0)
    };
    let errno = std::io::Error::last_os_error();
    match errno.raw_os_error() {
        Some(0) | None => Ok(nice),
        Some(_) => Err(format!("reading the server's priority: {errno}")),
    }
}

#[cfg(target_os = "linux")]
fn set_current_nice(nice: i32) -> std::io::Result<()> {
    // SAFETY: changes the scheduling priority of the calling thread only.
    match unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, nice) } {
        0 => Ok(()),
        _ => Err(std::io::Error::last_os_error()),
    }
}

#[cfg(not(target_os = "linux"))]
fn current_nice() -> Result<i32, String> {
    Ok(0)
}

#[cfg(not(target_os = "linux"))]
fn set_current_nice(_nice: i32) -> std::io::Result<()> {
    Ok(())
}

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;

    #[test]
    fn the_pool_has_its_threads_at_the_lower_priority() {
        let base = current_nice().unwrap();
        let pool = TrainerPool::new(TrainerThreads {
            threads: NonZeroUsize::new(3).unwrap(),
            nice: 5,
        })
        .unwrap();
        let want = (base + 5).min(MAX_NICE);
        assert_eq!((pool.threads(), pool.nice()), (3, want));
        assert_eq!(pool.install(rayon::current_num_threads), 3);
        let names_and_nices = pool.pool.broadcast(|_| {
            let name = std::thread::current().name().map(str::to_owned);
            (name, current_nice().unwrap())
        });
        let want_threads: Vec<(Option<String>, i32)> = (0..3)
            .map(|i| (Some(format!("temper-train-{i}")), want))
            .collect();
        assert_eq!(names_and_nices, want_threads);
        // The thread that built the pool keeps its priority.
        assert_eq!(current_nice().unwrap(), base);
    }
}
