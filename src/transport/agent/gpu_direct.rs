//! Whether peers may write this agent's device regions by GPUDirect RDMA,
//! and the flush that makes those writes visible to CUDA work before their
//! completion is delivered.
//!
//! A NIC's writes into device memory are seen in order by CUDA work only
//! where the device says so (`CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`
//! `OWNER` or `ALL_DEVICES`); where it says `NONE`, the receiver must call
//! `cuFlushGPUDirectRDMAWrites` after the NIC completed the writes and
//! before the consumer reads them. The engine reads the attribute once per
//! decode with device pools ([`RdmaWriteFlush`]) and gives the agent either
//! the flush ([`Agent::flush_gpu_direct_writes`]) or the reason GPUDirect
//! RDMA cannot be made consistent on that device
//! ([`Agent::refuse_gpu_direct`]): then the agent does not offer GPUDirect
//! in its handshake (an `auto` sender picks tcp), does not register its
//! device regions with the NIC, and refuses rdma batches into them. An
//! agent given neither (no engine) delivers as the NIC completes.

use super::{Agent, AgentInner};
use crate::error::{Error, Result, Status};
use crate::transport::rdma::nic::NicProvider;
use std::sync::Arc;

/// What the receiver runs after the sender committed an rdma batch that
/// wrote device memory and before its completion record is delivered.
pub(crate) trait RdmaWriteBarrier: Send + Sync {
    /// Makes the NIC's completed writes into device memory visible to CUDA
    /// work enqueued afterwards; returns whether it flushed. An error
    /// refuses the batch (Nack): nothing is delivered.
    fn before_delivery(&self) -> Result<bool>;
}

#[cfg(feature = "cuda")]
impl RdmaWriteBarrier for crate::cuda::RdmaWriteFlush {
    fn before_delivery(&self) -> Result<bool> {
        crate::cuda::RdmaWriteFlush::before_delivery(self)
    }
}

/// How an agent treats GPUDirect RDMA writes into its device regions.
#[derive(Clone)]
pub(crate) enum GpuDirectWrites {
    /// Run the barrier before each such batch's completion is delivered.
    Flush(Arc<dyn RdmaWriteBarrier>),
    /// They cannot be made consistent: GPUDirect RDMA into this agent's
    /// device regions is refused with this reason.
    Refused(Error),
}

impl AgentInner {
    /// Whether peers may move this agent's device regions through `nic`
    /// (GPUDirect RDMA): the NIC's answer, unless the device's writes
    /// cannot be made consistent (`NoGpuDirect` with the reason).
    pub(crate) fn gpu_direct(&self, nic: &dyn NicProvider) -> Result<()> {
        nic.gpu_direct()?;
        match self.gpu_writes.get() {
            Some(GpuDirectWrites::Refused(e)) => Err(e.clone()),
            _ => Ok(()),
        }
    }

    /// Called for a committed rdma batch that wrote device memory, before
    /// its completion is delivered: the flush, where the agent has one.
    pub(crate) fn before_device_delivery(&self) -> Result<()> {
        match self.gpu_writes.get() {
            Some(GpuDirectWrites::Flush(f)) => f.before_delivery().map(|_| ()),
            Some(GpuDirectWrites::Refused(e)) => Err(e.clone()),
            None => Ok(()),
        }
    }

    fn set_gpu_writes(&self, w: GpuDirectWrites) -> Result<()> {
        self.gpu_writes
            .set(w)
            .map_err(|_| Error::invalid("the agent's GPUDirect RDMA writes were already decided"))
    }
}

impl Agent {
    /// Peers' GPUDirect RDMA writes into this agent's device regions are
    /// made visible by `flush` before each batch's completion is delivered.
    /// Set once, before peers learn the agent's address.
    pub(crate) fn flush_gpu_direct_writes(&self, flush: Arc<dyn RdmaWriteBarrier>) -> Result<()> {
        self.inner.set_gpu_writes(GpuDirectWrites::Flush(flush))
    }

    /// GPUDirect RDMA into this agent's device regions cannot be made
    /// consistent (`why`): it is not offered to peers, and refused
    /// (`NoGpuDirect`). Set once, before peers learn the agent's address.
    pub(crate) fn refuse_gpu_direct(&self, why: &Error) -> Result<()> {
        self.inner
            .set_gpu_writes(GpuDirectWrites::Refused(Error::new(
                Status::NoGpuDirect,
                format!(
                    "GPUDirect RDMA into this receiver's device memory is off: {}",
                    why.detail()
                ),
            )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::RegionKind;
    use crate::transport::rdma::fake::FakeNic;
    use crate::transport::rdma::handshake::Mtu;
    use crate::transport::TestKnobs;
    use crate::transport::{
        AgentOptions, BatchOptions, ConnectOptions, Transport, TransportKind, WriteOp,
    };
    use crossbeam::channel::{bounded, Receiver, Sender};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::Duration;

    /// A barrier the test holds: each call says it entered, then waits for
    /// the test's release (which carries the answer).
    struct HeldFlush {
        entered: Sender<()>,
        release: Receiver<Result<bool>>,
        calls: AtomicU64,
    }

    impl RdmaWriteBarrier for HeldFlush {
        fn before_delivery(&self) -> Result<bool> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.entered.send(()).unwrap();
            self.release
                .recv_timeout(Duration::from_secs(20))
                .expect("the test releases the flush")
        }
    }

    fn agent(listen: bool, name: &str) -> (Agent, Arc<FakeNic>) {
        let nic = FakeNic::new(name, 1, Mtu::Mtu4096);
        let a = Agent::new(&AgentOptions {
            listen: listen.then(|| "127.0.0.1:0".to_string()),
            testing: TestKnobs {
                nic: Some(nic.clone() as Arc<dyn NicProvider>),
                deny_same_host: true,
                ..Default::default()
            },
            ..Default::default()
        })
        .unwrap();
        (a, nic)
    }

    fn connect(tx: &Agent, rx: &Agent, kind: TransportKind) -> Result<Box<dyn Transport>> {
        tx.connect(
            &rx.local_addr().unwrap().to_string(),
            &ConnectOptions {
                transport: kind,
                timeout: Duration::from_secs(5),
                ..Default::default()
            },
        )
    }

    fn op(src: u64, dst: u64, off: u64, len: u64) -> WriteOp {
        WriteOp {
            local_region: src,
            local_offset: off,
            remote_region: dst,
            remote_offset: off,
            len,
        }
    }

    #[test]
    fn a_gpudirect_batch_is_delivered_only_after_its_flush_returns() {
        let (rx, _) = agent(true, "flush-rx");
        let (tx, _) = agent(false, "flush-tx");
        let (entered_tx, entered) = bounded(4);
        let (release, release_rx) = bounded(4);
        let flush = Arc::new(HeldFlush {
            entered: entered_tx,
            release: release_rx,
            calls: AtomicU64::new(0),
        });
        rx.flush_gpu_direct_writes(flush.clone()).unwrap();
        assert!(
            rx.flush_gpu_direct_writes(flush.clone()).is_err(),
            "set twice"
        );
        let mut dev = vec![0u8; 1 << 16];
        let mut host = vec![0u8; 4096];
        let mut src: Vec<u8> = (0..1u32 << 16).map(|i| (i * 13 + 5) as u8).collect();
        // SAFETY: the buffers outlive the agents' use (the transport closes first).
        let (d, h, s) = unsafe {
            (
                rx.registry()
                    .register_device_unchecked(dev.as_mut_ptr() as u64, dev.len(), 0)
                    .unwrap(),
                rx.register_host(host.as_mut_ptr(), host.len()).unwrap(),
                tx.register_host(src.as_mut_ptr(), src.len()).unwrap(),
            )
        };
        let t = connect(&tx, &rx, TransportKind::Rdma).unwrap();
        assert_eq!(t.kind(), TransportKind::Rdma);
        for round in 0..3u64 {
            let id = t
                .submit(
                    &[op(s.id, d.id, round * 1000, 5000)],
                    &BatchOptions::default(),
                )
                .unwrap();
            // the flush runs after the NIC's writes completed ...
            entered.recv_timeout(Duration::from_secs(10)).unwrap();
            let at = (round * 1000) as usize;
            assert_eq!(&dev[at..at + 5000], &src[at..at + 5000]);
            // ... and nothing is delivered while it has not returned
            std::thread::sleep(Duration::from_millis(50));
            assert!(
                rx.try_completion().is_none(),
                "round {round}: delivered before its flush"
            );
            release.send(Ok(true)).unwrap();
            let inc = rx
                .next_completion(Duration::from_secs(10))
                .expect("delivered");
            assert_eq!(inc.completion, t.wait(id, Duration::from_secs(10)).unwrap());
        }
        assert_eq!(flush.calls.load(Ordering::SeqCst), 3);
        // a batch into host memory only is not flushed
        let id = t
            .submit(&[op(s.id, h.id, 0, 4096)], &BatchOptions::default())
            .unwrap();
        t.wait(id, Duration::from_secs(10)).unwrap();
        rx.next_completion(Duration::from_secs(10))
            .expect("delivered");
        assert_eq!(flush.calls.load(Ordering::SeqCst), 3);
        assert!(entered.try_recv().is_err());
        // a failed flush refuses the batch: no completion is delivered
        let id = t
            .submit(&[op(s.id, d.id, 0, 64)], &BatchOptions::default())
            .unwrap();
        entered.recv_timeout(Duration::from_secs(10)).unwrap();
        release
            .send(Err(Error::new(Status::Cuda, "injected flush failure")))
            .unwrap();
        let e = t.wait(id, Duration::from_secs(10)).unwrap_err();
        assert!(e.detail().contains("injected flush failure"), "{e}");
        assert!(rx.next_completion(Duration::from_millis(200)).is_none());
        t.close();
    }

    #[test]
    fn a_refused_device_is_not_offered_registered_or_written_by_gpudirect() {
        let (rx, rx_nic) = agent(true, "refused-rx");
        let (tx, _) = agent(false, "refused-tx");
        rx.rdma_gpu_direct().unwrap();
        let why = Error::new(
            Status::Unsupported,
            "CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING is NONE",
        );
        rx.refuse_gpu_direct(&why).unwrap();
        let e = rx.rdma_gpu_direct().unwrap_err();
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
        assert!(e.detail().contains("WRITES_ORDERING"), "{e}");
        let mut dev = vec![0u8; 1 << 16];
        let w = crate::transport::testing::HostAsDevice::new(&mut dev, None);
        let mut src = vec![3u8; 4096];
        // SAFETY: the writer accepts exactly the buffer's addresses; the
        // buffers outlive the agents' use.
        let (d, s) = unsafe {
            (
                rx.registry()
                    .register_device_unchecked_with(w.base, dev.len(), 0, Some(w.clone()))
                    .unwrap(),
                tx.register_host(src.as_mut_ptr(), src.len()).unwrap(),
            )
        };
        rx.rdma_register_all().unwrap();
        // auto: the receiver does not offer GPUDirect, so tcp (never rdma)
        let t = connect(&tx, &rx, TransportKind::Auto).unwrap();
        assert_eq!(t.kind(), TransportKind::Tcp);
        let id = t
            .submit(&[op(s.id, d.id, 0, 4096)], &BatchOptions::default())
            .unwrap();
        t.wait(id, Duration::from_secs(10)).unwrap();
        assert!(dev[..4096].iter().all(|&b| b == 3));
        t.close();
        // explicit rdma: the device region is refused at grant, nothing lands
        let t = connect(&tx, &rx, TransportKind::Rdma).unwrap();
        let into = WriteOp {
            remote_offset: 8192,
            ..op(s.id, d.id, 0, 64)
        };
        let id = t.submit(&[into], &BatchOptions::default());
        let e = match id {
            Ok(id) => t.wait(id, Duration::from_secs(10)).unwrap_err(),
            Err(e) => e,
        };
        assert_eq!(e.status(), Status::NoGpuDirect, "{e}");
        assert!(e.detail().contains("WRITES_ORDERING"), "{e}");
        assert!(dev[8192..8256].iter().all(|&b| b == 0));
        t.close();
        // the NIC never got the device region
        assert!(rx_nic.regions().iter().all(|r| r.kind == RegionKind::Host));
    }
}
