//! What a [`ReadyFlag`](super::ReadyFlag) set through
//! [`ReadyFlag::set`](super::ReadyFlag::set) wakes: the job queues holding a
//! send that waits for it, so the send starts as the flag is set instead of
//! at the queue's next look at its flags. A flag written by a plain store
//! (the C ABI's, or one written by a GPU) rings nothing and is still seen by
//! that look.

use super::state::lock;
use std::sync::{Mutex, Weak};

/// Told when a flag it watches was set.
pub(in crate::engine) trait FlagWatcher: Send + Sync {
    fn flag_set(&self);
}

/// The watchers of one flag (shared by its clones); dead ones are dropped
/// as new ones come.
#[derive(Default)]
pub(in crate::engine) struct ReadyBell {
    watchers: Mutex<Vec<Weak<dyn FlagWatcher>>>,
}

impl ReadyBell {
    /// Adds `w` (once) to the watchers.
    pub(in crate::engine) fn watch(&self, w: Weak<dyn FlagWatcher>) {
        let mut v = lock(&self.watchers);
        v.retain(|x| x.strong_count() > 0);
        if !v.iter().any(|x| Weak::ptr_eq(x, &w)) {
            v.push(w);
        }
    }

    /// The live watchers.
    #[cfg(test)]
    pub(in crate::engine) fn watchers(&self) -> usize {
        lock(&self.watchers)
            .iter()
            .filter(|w| w.strong_count() > 0)
            .count()
    }

    /// Tells every live watcher (after the flag was stored).
    pub(in crate::engine) fn ring(&self) {
        let live: Vec<_> = lock(&self.watchers)
            .iter()
            .filter_map(Weak::upgrade)
            .collect();
        for w in live {
            w.flag_set();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;

    #[derive(Default)]
    struct Count(AtomicUsize);
    impl FlagWatcher for Count {
        fn flag_set(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    #[test]
    fn rings_each_live_watcher_once() {
        let bell = ReadyBell::default();
        let (a, b) = (Arc::new(Count::default()), Arc::new(Count::default()));
        let wa: Weak<dyn FlagWatcher> = Arc::downgrade(&a) as Weak<dyn FlagWatcher>;
        bell.watch(wa.clone());
        bell.watch(wa);
        bell.watch(Arc::downgrade(&b) as Weak<dyn FlagWatcher>);
        drop(b);
        bell.ring();
        assert_eq!(a.0.load(Ordering::Relaxed), 1, "watched twice, told once");
        assert_eq!(lock(&bell.watchers).len(), 2);
        bell.watch(Arc::downgrade(&a) as Weak<dyn FlagWatcher>);
        assert_eq!(lock(&bell.watchers).len(), 1, "the dead watcher went");
    }
}
