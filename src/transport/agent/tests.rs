use super::*;
use crate::transport::tcp::DEVICE_BOUNCE_BYTES;
use crate::transport::testing::HostAsDevice;
use crate::transport::{BatchOptions, BatchStatus, WriteOp};
use std::sync::atomic::Ordering;

type Pair = (
    Agent,
    Agent,
    Vec<u8>,
    Vec<u8>,
    Box<dyn Transport>,
    RegionDesc,
    RegionDesc,
);

fn pair(kind: TransportKind, streams: u32) -> Pair {
    let rx = Agent::new(&AgentOptions {
        listen: Some("127.0.0.1:0".into()),
        ..Default::default()
    })
    .unwrap();
    let tx = Agent::new(&AgentOptions::default()).unwrap();
    let mut dst = vec![0u8; 1 << 20];
    let mut src: Vec<u8> = (0..(1u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    // SAFETY: the buffers are returned to the caller and outlive the agents' use.
    let d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
    // SAFETY: as above.
    let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    let addr = rx.local_addr().unwrap().to_string();
    let t = if kind == TransportKind::Local {
        tx.connect_local(&rx)
    } else {
        tx.connect(
            &addr,
            &ConnectOptions {
                transport: kind,
                streams,
                threads: 2,
                ..Default::default()
            },
        )
        .unwrap()
    };
    (rx, tx, dst, src, t, d, s)
}

fn roundtrip(kind: TransportKind, streams: u32) {
    let (rx, _tx, dst, src, t, d, s) = pair(kind, streams);
    assert_eq!(t.kind(), kind);
    assert_eq!(t.remote_regions(), vec![d.clone()]);
    let ops = vec![
        WriteOp {
            local_region: s.id,
            local_offset: 0,
            remote_region: d.id,
            remote_offset: 100,
            len: 4096,
        },
        WriteOp {
            local_region: s.id,
            local_offset: 5000,
            remote_region: d.id,
            remote_offset: 300_000,
            len: 700_000,
        },
        WriteOp {
            local_region: s.id,
            local_offset: 17,
            remote_region: d.id,
            remote_offset: 0,
            len: 1,
        },
    ];
    let opts = BatchOptions {
        checksum: true,
        room: 42,
        epoch: 3,
        ..Default::default()
    };
    let id = t.submit(&ops, &opts).unwrap();
    let c = t.wait(id, Duration::from_secs(10)).unwrap();
    assert_eq!(c.bytes, 4096 + 700_000 + 1);
    assert_eq!((c.room, c.epoch), (42, 3));
    assert!(c.checksum.is_some());
    let inc = rx
        .next_completion(Duration::from_secs(5))
        .expect("receiver completion");
    assert_eq!(inc.completion, c);
    assert_eq!(&dst[100..4196], &src[..4096]);
    assert_eq!(&dst[300_000..1_000_000], &src[5000..705_000]);
    assert_eq!(dst[0], src[17]);
    assert!(dst[4196..300_000].iter().all(|&b| b == 0));
    // Out of bounds: refused before anything is sent.
    let bad = [WriteOp {
        remote_offset: (1 << 20) - 10,
        len: 11,
        ..ops[0]
    }];
    let e = t.submit(&bad, &opts).unwrap_err();
    assert_eq!(e.status(), Status::OutOfBounds, "{e}");
    let bad = [WriteOp {
        remote_region: 99,
        ..ops[0]
    }];
    assert_eq!(
        t.submit(&bad, &opts).unwrap_err().status(),
        Status::RegionNotFound
    );
    // Polling: once terminal, the id is forgotten.
    let id = t.submit(&ops[..1], &BatchOptions::default()).unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        match t.poll(id).unwrap() {
            BatchStatus::Pending => assert!(std::time::Instant::now() < deadline),
            BatchStatus::Done(c) => {
                assert_eq!(c.bytes, 4096);
                break;
            }
            BatchStatus::Failed(e) => panic!("{e}"),
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    assert_eq!(t.poll(id).unwrap_err().status(), Status::InvalidArgument);
    // The receiver's region stays pinned-free afterwards and can be unregistered.
    std::thread::sleep(Duration::from_millis(20));
    rx.registry()
        .unregister(d.id, Duration::from_secs(2))
        .unwrap();
    t.close();
    assert!(!t.is_alive());
}

fn reads(kind: TransportKind, shared: bool) {
    let rx = Agent::new(&AgentOptions {
        listen: Some("127.0.0.1:0".into()),
        ..Default::default()
    })
    .unwrap();
    let tx = Agent::new(&AgentOptions::default()).unwrap();
    let mut heap = vec![0u8; 1 << 16];
    let d = if shared {
        rx.registry().alloc_shared(1 << 16).unwrap()
    } else {
        // SAFETY: heap outlives the agents' use in this test.
        unsafe { rx.register_host(heap.as_mut_ptr(), heap.len()) }.unwrap()
    };
    let base = rx.registry().check_access(d.id, 0, 1 << 16).unwrap();
    for i in 0..(1u64 << 16) {
        // SAFETY: inside the registered region.
        unsafe { *((base + i) as *mut u8) = (i * 5 + 1) as u8 };
    }
    let mut local = vec![0u8; 1 << 16];
    // SAFETY: local outlives the transport.
    let l = unsafe { tx.register_host(local.as_mut_ptr(), local.len()) }.unwrap();
    let t = if kind == TransportKind::Local {
        tx.connect_local(&rx)
    } else {
        let o = ConnectOptions {
            transport: kind,
            ..Default::default()
        };
        tx.connect(&rx.local_addr().unwrap().to_string(), &o)
            .unwrap()
    };
    let ops = [crate::transport::ReadOp {
        local_region: l.id,
        local_offset: 8,
        remote_region: d.id,
        remote_offset: 1000,
        len: 30_000,
    }];
    let opts = BatchOptions {
        checksum: true,
        ..Default::default()
    };
    let c = t
        .wait(
            t.submit_reads(&ops, &opts).unwrap(),
            Duration::from_secs(10),
        )
        .unwrap();
    assert_eq!(c.bytes, 30_000);
    assert!(c.checksum.is_some());
    for i in 0..30_000usize {
        assert_eq!(
            local[8 + i],
            ((1000 + i) * 5 + 1) as u8,
            "{kind:?} byte {i}"
        );
    }
    // A read leaves the peer's memory as it was.
    for i in 0..(1u64 << 16) {
        // SAFETY: base + i lies inside the registered 64 KiB region.
        let byte = unsafe { *((base + i) as *const u8) };
        assert_eq!(byte, (i * 5 + 1) as u8, "peer byte {i} changed");
    }
    // The peer delivers no completion record for reads.
    assert!(rx.next_completion(Duration::from_millis(50)).is_none());
    let bad = [crate::transport::ReadOp {
        remote_offset: 60_000,
        len: 10_000,
        ..ops[0]
    }];
    assert_eq!(
        t.submit_reads(&bad, &opts).unwrap_err().status(),
        Status::OutOfBounds
    );
    drop(heap);
}

#[test]
fn reads_over_local_and_cma() {
    reads(TransportKind::Local, false);
    reads(TransportKind::Cma, false);
    reads(TransportKind::Cma, true);
    let (_rx, _tx, _d, _s, t, d, s) = pair(TransportKind::Tcp, 1);
    let op = crate::transport::ReadOp {
        local_region: s.id,
        local_offset: 0,
        remote_region: d.id,
        remote_offset: 0,
        len: 1,
    };
    let e = t.submit_reads(&[op], &BatchOptions::default()).unwrap_err();
    assert_eq!(e.status(), Status::Unsupported);
}

#[test]
fn local_roundtrip() {
    roundtrip(TransportKind::Local, 1);
}

#[test]
fn cma_roundtrip_in_process() {
    roundtrip(TransportKind::Cma, 1);
}

#[test]
fn tcp_roundtrip_in_process() {
    roundtrip(TransportKind::Tcp, 1);
    roundtrip(TransportKind::Tcp, 3);
}

#[test]
fn auto_picks_cma_on_this_host_and_rdma_is_typed() {
    let (_rx, _tx, _d, _s, t, _, _) = pair(TransportKind::Auto, 1);
    assert_eq!(t.kind(), TransportKind::Cma);
    let tx = Agent::new(&AgentOptions::default()).unwrap();
    let e = tx
        .connect(
            "127.0.0.1:1",
            &ConnectOptions {
                transport: TransportKind::Rdma,
                ..Default::default()
            },
        )
        .unwrap_err();
    // Without a usable NIC here: the typed NoRdmaDevice with the reason,
    // before dialing; with NICs, the dial itself fails.
    if tx.inner.nic().is_err() {
        assert_eq!(e.status(), Status::NoRdmaDevice, "{e}");
        assert!(!e.detail().is_empty());
    } else {
        assert_eq!(e.status(), Status::PeerUnreachable, "{e}");
    }
    let e = tx
        .connect(
            "127.0.0.1:1",
            &ConnectOptions {
                transport: TransportKind::Tcp,
                ..Default::default()
            },
        )
        .unwrap_err();
    assert_eq!(e.status(), Status::PeerUnreachable);
}

#[test]
fn tcp_into_a_device_region_completes_after_the_copies_and_auto_skips_cma() {
    let rx = Agent::new(&AgentOptions {
        listen: Some("127.0.0.1:0".into()),
        ..Default::default()
    })
    .unwrap();
    let tx = Agent::new(&AgentOptions::default()).unwrap();
    let mut dev = vec![0u8; 6 << 20];
    let w = HostAsDevice::new(&mut dev, None);
    // SAFETY: the writer accepts exactly the buffer's addresses; dev outlives the agents' use.
    let d = unsafe {
        rx.registry()
            .register_device_unchecked_with(w.base, dev.len(), 0, Some(w.clone()))
    }
    .unwrap();
    let mut src: Vec<u8> = (0..(6u32 << 20)).map(|i| (i * 7 + 3) as u8).collect();
    // SAFETY: src outlives the agents' use.
    let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    let addr = rx.local_addr().unwrap().to_string();
    let t = tx
        .connect(
            &addr,
            &ConnectOptions {
                transport: TransportKind::Tcp,
                streams: 2,
                ..Default::default()
            },
        )
        .unwrap();
    assert_eq!(t.kind(), TransportKind::Tcp);
    let ops = [
        WriteOp {
            local_region: s.id,
            local_offset: 3,
            remote_region: d.id,
            remote_offset: 10,
            len: 5 << 20,
        },
        WriteOp {
            local_region: s.id,
            local_offset: 0,
            remote_region: d.id,
            remote_offset: (6 << 20) - 1,
            len: 1,
        },
    ];
    let opts = BatchOptions {
        checksum: true,
        room: 7,
        ..Default::default()
    };
    let id = t.submit(&ops, &opts).unwrap();
    let c = t.wait(id, Duration::from_secs(20)).unwrap();
    let inc = rx.next_completion(Duration::from_secs(5)).unwrap();
    assert_eq!(inc.completion, c);
    // delivered after every byte went through the writer
    assert_eq!(&dev[10..10 + (5 << 20)], &src[3..3 + (5 << 20)]);
    assert_eq!(dev[(6 << 20) - 1], src[0]);
    assert!(dev[..10].iter().all(|&b| b == 0));
    assert!(w.writes.load(Ordering::SeqCst) >= 2);
    assert!(w.largest.load(Ordering::SeqCst) <= DEVICE_BOUNCE_BYTES as u64);
    t.close();
    // Same host, but the peer has device memory: auto never picks cma; it
    // picks rdma exactly when both sides have a NIC and the receiver's can
    // take GPU memory (GPUDirect RDMA), else tcp.
    let auto = ConnectOptions {
        transport: TransportKind::Auto,
        ..Default::default()
    };
    let want = if tx.inner.nic().is_ok() && rx.rdma_gpu_direct().is_ok() {
        TransportKind::Rdma
    } else {
        TransportKind::Tcp
    };
    let t = tx.connect(&addr, &auto).unwrap();
    assert_eq!(t.kind(), want, "this host's NICs: {:?}", rx.rdma_nics());
    t.close();
    // the same choice on fake NICs, with and without GPUDirect RDMA
    for gpu_direct in [false, true] {
        let nic = |name: &str| {
            let n = crate::transport::rdma::fake::FakeNic::new(
                name,
                1,
                crate::transport::rdma::handshake::Mtu::Mtu4096,
            );
            n.set_gpu_direct(gpu_direct || name.ends_with("tx"));
            Some(n as Arc<dyn NicProvider>)
        };
        let frx = Agent::new(&AgentOptions {
            listen: Some("127.0.0.1:0".into()),
            testing: TestKnobs {
                nic: nic(&format!("auto-dev-{gpu_direct}-rx")),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        let ftx = Agent::new(&AgentOptions {
            testing: TestKnobs {
                nic: nic(&format!("auto-dev-{gpu_direct}-tx")),
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        // SAFETY: as above (dev outlives the agents' use).
        unsafe {
            frx.registry()
                .register_device_unchecked_with(w.base, dev.len(), 0, Some(w.clone()))
        }
        .unwrap();
        let t = ftx
            .connect(&frx.local_addr().unwrap().to_string(), &auto)
            .unwrap();
        let want = if gpu_direct {
            TransportKind::Rdma
        } else {
            TransportKind::Tcp
        };
        assert_eq!(t.kind(), want, "receiver GPUDirect RDMA: {gpu_direct}");
        t.close();
    }
    // Explicit cma into device memory: refused, nothing written.
    let t = tx
        .connect(
            &addr,
            &ConnectOptions {
                transport: TransportKind::Cma,
                ..Default::default()
            },
        )
        .unwrap();
    let before = w.writes.load(Ordering::SeqCst);
    let op = [WriteOp {
        local_region: s.id,
        local_offset: 0,
        remote_region: d.id,
        remote_offset: 0,
        len: 8,
    }];
    let e = match t.submit(&op, &BatchOptions::default()) {
        Err(e) => e,
        Ok(id) => t.wait(id, Duration::from_secs(10)).unwrap_err(),
    };
    assert_eq!(e.status(), Status::Unsupported, "{e}");
    assert!(dev[..10].iter().all(|&b| b == 0));
    assert_eq!(w.writes.load(Ordering::SeqCst), before);
    t.close();
}
