//! Where pdxfer's threads run. Every thread the library starts goes through
//! [`spawn`], which places the new thread on the CPUs of the *process*, not
//! only those of the thread that happened to start it.
//!
//! A serving engine often pins the thread that creates the engine: vLLM's CPU
//! worker binds its main thread (the OpenMP master) to one core, SGLang and
//! NUMA-aware launchers bind per GPU. A Linux thread inherits its creator's
//! affinity, so without this every control, receive and copy thread would
//! share that one core with a main thread that spins between steps; under
//! `vllm serve` on the CPU that starved the receiver's answers for tens of
//! seconds (room ends timed out, a first request took 65 s).
//!
//! `PDXFER_THREAD_CPUS` chooses, read once per process:
//! - unset or `auto`: the union of the affinities of the process's threads
//!   when the first pdxfer thread starts (a `taskset`/`numactl` binding of
//!   the whole process is kept; one pinned thread does not narrow it);
//! - `inherit`: the creator's affinity, as a plain `std::thread` would;
//! - a CPU list (`0-3,8`): exactly those CPUs.
//!
//! A placement the kernel refuses (a CPU outside the cgroup's cpuset) leaves
//! the thread where it was, with one warning per process.

use std::io;
use std::sync::OnceLock;
use std::thread::JoinHandle;

/// How new pdxfer threads are placed (parsed from `PDXFER_THREAD_CPUS`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ThreadCpus {
    /// The union of the process's threads' affinities.
    Process,
    /// The creating thread's affinity.
    Inherit,
    /// These CPUs, ascending.
    List(Vec<usize>),
}

impl ThreadCpus {
    /// Parses `auto`, `inherit` or a CPU list such as `0-3,8` (`None`/empty: `auto`).
    pub fn parse(s: Option<&str>) -> Result<ThreadCpus, String> {
        let s = s.map(str::trim).unwrap_or("");
        match s {
            "" | "auto" => Ok(ThreadCpus::Process),
            "inherit" => Ok(ThreadCpus::Inherit),
            _ => parse_cpu_list(s).map(ThreadCpus::List),
        }
    }
}

/// Parses a Linux CPU list (`0-3,8,10-11`): ascending, without repeats.
pub fn parse_cpu_list(s: &str) -> Result<Vec<usize>, String> {
    let bad = |why: &str| {
        format!("PDXFER_THREAD_CPUS={s:?}: {why} (want auto, inherit or a CPU list like 0-3,8)")
    };
    let mut out = Vec::new();
    for part in s.split(',').map(str::trim) {
        let (lo, hi) = match part.split_once('-') {
            Some((a, b)) => (a.trim(), b.trim()),
            None => (part, part),
        };
        let lo: usize = lo.parse().map_err(|_| bad("not a CPU number"))?;
        let hi: usize = hi.parse().map_err(|_| bad("not a CPU number"))?;
        if lo > hi {
            return Err(bad("a range runs backwards"));
        }
        if hi >= MAX_CPUS {
            return Err(bad(&format!(
                "CPU {hi} is beyond the {MAX_CPUS} a cpu set holds"
            )));
        }
        out.extend(lo..=hi);
    }
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

/// CPUs a `cpu_set_t` holds.
const MAX_CPUS: usize = 8 * std::mem::size_of::<libc::cpu_set_t>();

/// The CPU set new threads get, or `None` to leave them as created.
fn target() -> Option<&'static libc::cpu_set_t> {
    static TARGET: OnceLock<Option<libc::cpu_set_t>> = OnceLock::new();
    TARGET
        .get_or_init(|| {
            let env = std::env::var("PDXFER_THREAD_CPUS").ok();
            let choice = ThreadCpus::parse(env.as_deref()).unwrap_or_else(|e| {
                log::warn!("{e}; placing pdxfer's threads on the process's CPUs");
                ThreadCpus::Process
            });
            match choice {
                ThreadCpus::Inherit => None,
                ThreadCpus::List(cpus) => Some(set_of(&cpus)),
                ThreadCpus::Process => process_cpus(),
            }
        })
        .as_ref()
}

fn set_of(cpus: &[usize]) -> libc::cpu_set_t {
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: c < MAX_CPUS (checked by parse_cpu_list or by the caller's range).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    set
}

/// The CPUs in `set`, ascending.
pub(crate) fn cpus_of(set: &libc::cpu_set_t) -> Vec<usize> {
    // SAFETY: CPU_ISSET reads one bit of a valid set; c < MAX_CPUS.
    (0..MAX_CPUS)
        .filter(|&c| unsafe { libc::CPU_ISSET(c, set) })
        .collect()
}

/// The affinity of thread `tid` (0: the calling thread).
pub(crate) fn affinity(tid: libc::pid_t) -> Option<libc::cpu_set_t> {
    // SAFETY: cpu_set_t is a plain bit array; all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid, writable cpu_set_t of the size passed.
    let r =
        unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) };
    (r == 0).then_some(set)
}

/// The union of the affinities of this process's threads (the calling
/// thread's alone when `/proc/self/task` cannot be read).
fn process_cpus() -> Option<libc::cpu_set_t> {
    let mut all = affinity(0)?;
    if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
        for tid in dir
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<libc::pid_t>().ok())
        {
            if let Some(s) = affinity(tid) {
                for c in cpus_of(&s) {
                    // SAFETY: c < MAX_CPUS (a bit of a valid set).
                    unsafe { libc::CPU_SET(c, &mut all) };
                }
            }
        }
    }
    Some(all)
}

/// Moves the calling thread onto the placement's CPUs (nothing for `inherit`).
fn place_current() {
    let Some(want) = target() else { return };
    // SAFETY: `want` is a valid cpu_set_t of the size passed; tid 0 is this thread.
    let r = unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), want) };
    if r != 0 {
        static WARNED: OnceLock<()> = OnceLock::new();
        let err = io::Error::last_os_error();
        WARNED.get_or_init(|| {
            log::warn!(
                "pdxfer threads stay on their creator's CPUs: the kernel refused CPUs {:?}: {err}",
                cpus_of(want)
            )
        });
    }
}

/// Starts a named library thread, placed as `PDXFER_THREAD_CPUS` says.
pub(crate) fn spawn<F, T>(name: String, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    spawn_with(std::thread::Builder::new().name(name), f)
}

/// [`spawn`] from a configured builder (a stack size, say).
pub(crate) fn spawn_with<F, T>(b: std::thread::Builder, f: F) -> io::Result<JoinHandle<T>>
where
    F: FnOnce() -> T + Send + 'static,
    T: Send + 'static,
{
    b.spawn(move || {
        place_current();
        f()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_auto_inherit_and_lists() {
        assert_eq!(ThreadCpus::parse(None), Ok(ThreadCpus::Process));
        assert_eq!(ThreadCpus::parse(Some(" auto ")), Ok(ThreadCpus::Process));
        assert_eq!(ThreadCpus::parse(Some("inherit")), Ok(ThreadCpus::Inherit));
        assert_eq!(
            ThreadCpus::parse(Some("8,0-2, 2")),
            Ok(ThreadCpus::List(vec![0, 1, 2, 8]))
        );
        for bad in ["x", "3-1", "1-", "0,,1", "99999"] {
            let e = ThreadCpus::parse(Some(bad)).unwrap_err();
            assert!(
                e.contains("PDXFER_THREAD_CPUS") && e.contains("CPU list"),
                "{bad}: {e}"
            );
        }
    }

    #[test]
    fn a_thread_started_from_a_pinned_thread_runs_on_the_process_cpus() {
        let all = cpus_of(&process_cpus().unwrap());
        let first = all[0];
        let pinned = std::thread::spawn(move || {
            // pin this thread to one CPU, as vLLM pins its OpenMP master
            let one = set_of(&[first]);
            // SAFETY: `one` is a valid cpu_set_t of the size passed; tid 0 is this thread.
            let r =
                unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &one) };
            assert_eq!(r, 0);
            let plain = std::thread::spawn(|| cpus_of(&affinity(0).unwrap()))
                .join()
                .unwrap();
            let ours = spawn("pdxfer-test".into(), || cpus_of(&affinity(0).unwrap()))
                .unwrap()
                .join()
                .unwrap();
            (plain, ours)
        });
        let (plain, ours) = pinned.join().unwrap();
        assert_eq!(
            plain,
            vec![all[0]],
            "a std thread inherits its creator's pin"
        );
        assert_eq!(
            ours,
            cpus_of(target().unwrap()),
            "a pdxfer thread gets the placement"
        );
        assert!(
            ours.len() >= all.len().min(2),
            "not narrowed to the creator's CPU: {ours:?} of {all:?}"
        );
    }

    #[test]
    fn sets_round_trip() {
        assert_eq!(cpus_of(&set_of(&[0, 3, 1023])), vec![0, 3, 1023]);
    }
}
