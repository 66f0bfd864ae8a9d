//! One NIC memory region per interleaved allocation: pool views that overlap
//! (block-outermost KV caches, where every layer's pages interleave in one
//! allocation, so each layer's view spans nearly all of it) are registered
//! as their hull, once. Every view inside it uses the hull's keys, the peer
//! is told the hull's rkey (one advertised region for all of them), and the
//! hull is deregistered when the last of its views is. One region rather
//! than one per view: verbs would accept overlapping registrations, but each
//! one pins the pages again and takes its own MTT entries.
//!
//! Ranges that are no view pass through to the NIC unchanged.

use super::nic::{NicEndpoint, NicProvider};
use super::slice::LocalRegion;
use crate::error::{Error, Result, Status};
use crate::memory::RegionKind;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex, MutexGuard};

/// The hull of the views connected to a range, in the range's address space
/// (`None`: the range is no view): [`Registry::view_hull`](crate::memory::Registry::view_hull).
pub type HullOf = Arc<dyn Fn(u64, u64, RegionKind) -> Option<(u64, u64)> + Send + Sync>;

/// One registered hull and the views using it.
struct Hull {
    addr: u64,
    len: u64,
    device: bool,
    keys: Vec<LocalRegion>,
    /// The views (`(addr, len)`) registered inside it: it lives while any does.
    views: BTreeSet<(u64, u64)>,
}

impl Hull {
    fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr && addr.saturating_add(len) <= self.addr + self.len
    }
    fn overlaps(&self, addr: u64, len: u64) -> bool {
        addr < self.addr + self.len && self.addr < addr.saturating_add(len)
    }
}

/// A [`NicProvider`] that registers overlapping views as one hull region.
pub struct ViewHulls {
    nic: Arc<dyn NicProvider>,
    hull_of: HullOf,
    hulls: Mutex<Vec<Hull>>,
}

impl ViewHulls {
    /// `nic`, with the views `hull_of` finds registered by hull.
    pub fn wrap(nic: Arc<dyn NicProvider>, hull_of: HullOf) -> Arc<dyn NicProvider> {
        Arc::new(ViewHulls {
            nic,
            hull_of,
            hulls: Mutex::new(Vec::new()),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Hull>> {
        // the list is consistent between statements: a panic elsewhere leaves it usable
        self.hulls.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn same_space(device: bool, kind: RegionKind) -> bool {
    device == !matches!(kind, RegionKind::Host)
}

impl NicProvider for ViewHulls {
    fn describe(&self) -> String {
        self.nic.describe()
    }

    unsafe fn register(&self, addr: u64, len: u64, kind: RegionKind) -> Result<Vec<LocalRegion>> {
        // held across the NIC call: two views of one hull register it once
        let mut hulls = self.lock();
        if let Some(h) = hulls
            .iter_mut()
            .find(|h| same_space(h.device, kind) && h.contains(addr, len))
        {
            h.views.insert((addr, len));
            return Ok(h.keys.clone());
        }
        let Some((ha, hl)) = (self.hull_of)(addr, len, kind) else {
            // SAFETY: the caller's contract, passed on.
            return unsafe { self.nic.register(addr, len, kind) };
        };
        if let Some(h) = hulls
            .iter()
            .find(|h| same_space(h.device, kind) && h.overlaps(ha, hl))
        {
            return Err(Error::new(
                Status::RegionOverlap,
                format!(
                    "view {addr:#x}+{len} widens the allocation {:#x}+{} its overlapping views were registered with the NIC as: register every view of an allocation before its first rdma use",
                    h.addr, h.len
                ),
            ));
        }
        // SAFETY: the hull is the union of registered views the caller keeps
        // valid (one allocation); it is deregistered when the last one goes.
        let keys = unsafe { self.nic.register(ha, hl, kind) }?;
        hulls.push(Hull {
            addr: ha,
            len: hl,
            device: !matches!(kind, RegionKind::Host),
            keys: keys.clone(),
            views: BTreeSet::from([(addr, len)]),
        });
        Ok(keys)
    }

    fn deregister(&self, addr: u64, len: u64) -> Result<bool> {
        let mut hulls = self.lock();
        let Some(i) = hulls.iter().position(|h| h.views.contains(&(addr, len))) else {
            drop(hulls);
            return self.nic.deregister(addr, len);
        };
        hulls[i].views.remove(&(addr, len));
        if hulls[i].views.is_empty() {
            let h = hulls.remove(i);
            self.nic.deregister(h.addr, h.len)?;
        }
        Ok(true)
    }

    fn gpu_direct(&self) -> Result<()> {
        self.nic.gpu_direct()
    }

    fn endpoint(&self) -> Result<Box<dyn NicEndpoint>> {
        self.nic.endpoint()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::rdma::fake::FakeNic;
    use crate::transport::rdma::handshake::Mtu;

    /// Three layers' views interleaved in one 3000 B allocation (page 100 B,
    /// stride 300 B) and a plain region beside it.
    #[test]
    fn overlapping_views_share_one_region_released_with_the_last_view() {
        let fake = FakeNic::new("hull", 2, Mtu::Mtu4096);
        let buf = vec![0u8; 4096];
        let base = buf.as_ptr() as u64;
        let views: Vec<(u64, u64)> = (0..3).map(|l| (base + 100 * l, 2800)).collect();
        let known = views.clone();
        let nic = ViewHulls::wrap(
            fake.clone(),
            Arc::new(move |a, l, k: RegionKind| {
                matches!(k, RegionKind::Host)
                    .then(|| crate::memory::view_hull(&known, a, l))
                    .flatten()
            }),
        );
        let mut keys = Vec::new();
        for &(a, l) in &views {
            // SAFETY: `buf` outlives every registration (all deregistered below).
            keys.push(unsafe { nic.register(a, l, RegionKind::Host) }.unwrap());
        }
        // SAFETY: as above.
        let plain = unsafe { nic.register(base + 3000, 1000, RegionKind::Host) }.unwrap();
        // one NIC region for the three views, with the hull's range and keys on each rail
        let regs = fake.regions();
        assert_eq!(regs.len(), 2, "{regs:?}");
        assert_eq!((regs[0].addr, regs[0].len), (base, 3000));
        assert_eq!((plain[0].addr, plain[0].len), (base + 3000, 1000));
        for k in &keys {
            assert_eq!(k, &keys[0]);
            assert_eq!(k.len(), 2);
            assert_eq!((k[0].addr, k[0].len), (base, 3000));
            assert_eq!(k[0].lkey, regs[0].keys[0]);
        }
        // a range inside the hull that is no registered view deregisters nothing
        assert!(!nic.deregister(base, 1).unwrap());
        assert_eq!(fake.regions().len(), 2);
        // deregistering views keeps the hull while one remains
        assert!(nic.deregister(views[0].0, views[0].1).unwrap());
        assert!(nic.deregister(views[2].0, views[2].1).unwrap());
        assert_eq!(fake.regions().len(), 2);
        // the remaining view still gets the same keys (registering again is a lookup)
        // SAFETY: as above.
        let again = unsafe { nic.register(views[1].0, views[1].1, RegionKind::Host) }.unwrap();
        assert_eq!(again, keys[1]);
        assert!(nic.deregister(views[1].0, views[1].1).unwrap());
        let regs = fake.regions();
        assert_eq!(regs.len(), 1, "the hull goes with its last view: {regs:?}");
        assert_eq!(regs[0].addr, base + 3000);
        assert!(nic.deregister(base + 3000, 1000).unwrap());
        assert!(fake.regions().is_empty());
    }

    #[test]
    fn a_view_widening_a_registered_hull_is_refused() {
        let fake = FakeNic::new("hullw", 1, Mtu::Mtu4096);
        let buf = vec![0u8; 4096];
        let base = buf.as_ptr() as u64;
        let live = Arc::new(Mutex::new(vec![(base, 2000)]));
        let l2 = live.clone();
        let nic = ViewHulls::wrap(
            fake.clone(),
            Arc::new(move |a, l, _| crate::memory::view_hull(&l2.lock().unwrap(), a, l)),
        );
        // SAFETY: `buf` outlives every registration.
        unsafe { nic.register(base, 2000, RegionKind::Host) }.unwrap();
        // a view added later that reaches past the registered hull
        live.lock().unwrap().push((base + 1000, 2000));
        // SAFETY: as above.
        let e = unsafe { nic.register(base + 1000, 2000, RegionKind::Host) }.unwrap_err();
        assert_eq!(e.status(), Status::RegionOverlap, "{e}");
        assert!(e.detail().contains("before its first rdma use"), "{e}");
        assert_eq!(fake.regions().len(), 1);
        assert!(nic.deregister(base, 2000).unwrap());
        assert!(fake.regions().is_empty());
    }
}
