//! The etcd backend in-process against a private etcd: leases, atomic
//! replacement with a larger epoch, replacement detection by the old owner,
//! deregistration that leaves a newer owner alone, isolation by namespace.

use crate::support as common;

use common::{poll, Etcd};
use pdxfer::bootstrap::{EtcdStore, InstanceId, LeaseState, Registrar, Registration, Role, Store};
use pdxfer::layout::Topology;
use pdxfer::Status;
use std::sync::Arc;
use std::time::Duration;

fn reg(cluster: &str, tp: u32, tp_size: u32) -> Registration {
    let mut t = Topology::single_mla(64, 2, 1152);
    t.attn_tp_size = tp_size;
    t.attn_tp_rank = tp;
    Registration::new(cluster, Role::Prefill, InstanceId::random().unwrap(), t)
}

#[test]
fn etcd_leases_replacement_and_namespaces() {
    let Some(etcd) = Etcd::start() else { return };
    let store: Arc<dyn Store> = Arc::new(EtcdStore::new(&etcd.url, "ns1").unwrap());
    let other_ns = EtcdStore::new(&etcd.url, "ns2").unwrap();
    let ttl = Duration::from_secs(2);

    assert_eq!(
        store
            .register(&reg("c", 0, 1), Duration::from_millis(500))
            .unwrap_err()
            .status(),
        Status::InvalidArgument,
        "etcd leases shorter than 2 s are refused"
    );
    let first = Registrar::start(store.clone(), reg("c", 0, 2), ttl).unwrap();
    let second = Registrar::start(store.clone(), reg("c", 1, 2), ttl).unwrap();
    // Alive across two TTLs.
    std::thread::sleep(Duration::from_millis(2500));
    let s = store.summary("c", Role::Prefill).unwrap();
    assert!(s.ready, "{s:?}");
    assert_eq!(first.lease_state(), LeaseState::Live);
    assert_eq!(
        store
            .lookup("c", Role::Prefill, &first.registration().key())
            .unwrap(),
        first.registration()
    );
    assert!(other_ns.entries("c", Role::Prefill).unwrap().is_empty());

    // Another process takes rank 1: one transaction, a larger epoch.
    let usurper = reg("c", 1, 2);
    let ack = store.register(&usurper, ttl).unwrap();
    assert!(ack.replaced && ack.epoch > second.registration().epoch);
    let got = store.lookup("c", Role::Prefill, &usurper.key()).unwrap();
    assert_eq!(got.instance_id, usurper.instance_id);
    assert_eq!(got.epoch, ack.epoch);
    assert!(
        poll(Duration::from_secs(3), || matches!(
            second.lease_state(),
            LeaseState::Replaced(_)
        )
        .then_some(()))
        .is_some(),
        "old owner never noticed: {:?}",
        second.lease_state()
    );
    // The old owner's deregistration leaves the usurper's entry alone.
    second.deregister().unwrap();
    assert_eq!(
        store
            .lookup("c", Role::Prefill, &usurper.key())
            .unwrap()
            .instance_id,
        usurper.instance_id
    );
    first.deregister().unwrap();
    store.deregister(ack.lease_id).unwrap();
    assert!(store.entries("c", Role::Prefill).unwrap().is_empty());
    assert_eq!(
        store.keepalive(ack.lease_id).unwrap_err().status(),
        Status::NotRegistered
    );
}
