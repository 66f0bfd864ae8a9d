//! Encrypted tcp payloads (`AgentOptions::tcp_encrypt`) between two agents
//! over real loopback sockets, through a recording forwarder: a batch of
//! scattered 4 KiB rows and a 1 MiB write lands byte-exact over several
//! streams, and none of its plaintext crosses the wire (the same batch
//! unencrypted does); a bit flipped on the wire inside an encrypted piece
//! fails the batch and writes nothing; a sender and a receiver that disagree
//! are refused with `transport_unavailable` naming both settings, writing
//! nothing.

use pdxfer::transport::{
    Agent, AgentOptions, BatchOptions, ConnectOptions, Transport, TransportKind, WriteOp,
};
use pdxfer::Status;
use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SECRET: &str = "tcp-encrypt-test-secret-0123456789";
const ROW: usize = 4096;
const ROWS: usize = 256;
const BIG: usize = 1 << 20;

/// Forwards every connection made to its port to `upstream`, recording the
/// bytes the client sends.
fn recording_forwarder(upstream: String) -> (String, Arc<Mutex<Vec<u8>>>) {
    forwarder(upstream, None)
}

/// [`recording_forwarder`] that flips one bit of what the client sends on
/// its `flip.0`-th connection (from 0), at byte `flip.1` of it.
fn forwarder(upstream: String, flip: Option<(usize, usize)>) -> (String, Arc<Mutex<Vec<u8>>>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let rec = seen.clone();
    std::thread::spawn(move || {
        for (conn, c) in l.incoming().enumerate() {
            let Ok(down) = c else { return };
            let Ok(up) = TcpStream::connect(&upstream) else {
                return;
            };
            let (mut d2, mut u2) = (down.try_clone().unwrap(), up.try_clone().unwrap());
            let rec = rec.clone();
            // client -> server, recorded
            std::thread::spawn(move || {
                let mut b = vec![0u8; 64 << 10];
                let mut up = up;
                let mut down = down;
                let mut at = 0usize;
                while let Ok(n) = down.read(&mut b) {
                    if n == 0 {
                        break;
                    }
                    if let Some((c, x)) = flip {
                        if c == conn && (at..at + n).contains(&x) {
                            b[x - at] ^= 0x08;
                        }
                    }
                    at += n;
                    if up.write_all(&b[..n]).is_err() {
                        break;
                    }
                    rec.lock().unwrap().extend_from_slice(&b[..n]);
                }
                let _ = up.shutdown(Shutdown::Write);
            });
            // server -> client
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut u2, &mut d2);
                let _ = d2.shutdown(Shutdown::Write);
            });
        }
    });
    (addr, seen)
}

fn agent(listen: bool, encrypt: bool) -> Agent {
    Agent::new(&AgentOptions {
        listen: listen.then(|| "127.0.0.1:0".to_string()),
        secret: Some(SECRET.to_string()),
        tcp_encrypt: Some(encrypt),
        ..AgentOptions::default()
    })
    .unwrap()
}

fn connect(tx: &Agent, addr: &str) -> pdxfer::Result<Box<dyn Transport>> {
    tx.connect(
        addr,
        &ConnectOptions {
            transport: TransportKind::Tcp,
            streams: 3,
            timeout: Duration::from_secs(10),
            ..ConnectOptions::default()
        },
    )
}

/// A source byte pattern that never repeats within 251 bytes.
fn pattern(len: usize, seed: usize) -> Vec<u8> {
    (0..len).map(|i| ((i * 31 + seed) % 251) as u8).collect()
}

/// Moves 256 scattered rows of 4 KiB (every other source row, to
/// consecutive destination rows) and one 1 MiB write, checksummed; checks
/// every destination byte; returns what the sender put on the wire.
fn move_batch(encrypt: bool) -> Vec<u8> {
    let rx = agent(true, encrypt);
    let tx = agent(false, encrypt);
    let mut dst = vec![0u8; ROWS * ROW + BIG + 4096];
    let mut src = pattern(2 * ROWS * ROW + BIG, 7);
    // SAFETY: both buffers outlive the agents' use of them (the agents drop first below).
    let d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
    // SAFETY: as above.
    let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    let (addr, seen) = recording_forwarder(rx.local_addr().unwrap().to_string());
    let t = connect(&tx, &addr).unwrap();
    let mut ops: Vec<WriteOp> = (0..ROWS)
        .map(|i| WriteOp {
            local_region: s.id,
            local_offset: (2 * i * ROW) as u64,
            remote_region: d.id,
            remote_offset: (i * ROW) as u64,
            len: ROW as u64,
        })
        .collect();
    ops.push(WriteOp {
        local_region: s.id,
        local_offset: (2 * ROWS * ROW) as u64,
        remote_region: d.id,
        remote_offset: (ROWS * ROW + 4096) as u64,
        len: BIG as u64,
    });
    let opts = BatchOptions {
        checksum: true,
        ..BatchOptions::default()
    };
    let id = t.submit(&ops, &opts).unwrap();
    let c = t.wait(id, Duration::from_secs(30)).unwrap();
    assert_eq!(c.bytes, (ROWS * ROW + BIG) as u64);
    rx.next_completion(Duration::from_secs(10))
        .expect("the receiver's completion");
    for i in 0..ROWS {
        assert!(
            dst[i * ROW..(i + 1) * ROW] == src[2 * i * ROW..(2 * i + 1) * ROW],
            "row {i} differs"
        );
    }
    let big = ROWS * ROW + 4096;
    assert!(dst[ROWS * ROW..big].iter().all(|&b| b == 0));
    assert!(
        dst[big..big + BIG] == src[2 * ROWS * ROW..],
        "the 1 MiB write differs"
    );
    t.close();
    drop(tx);
    drop(rx);
    let wire = seen.lock().unwrap().clone();
    assert!(
        wire.len() >= ROWS * ROW + BIG,
        "{} bytes recorded",
        wire.len()
    );
    wire
}

/// Whether `needle` occurs in `hay`.
fn contains(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len()).any(|w| w == needle)
}

#[test]
fn an_encrypted_batch_lands_byte_exact_and_no_plaintext_crosses_the_wire() {
    // 64 bytes from inside the 1 MiB source and from one row
    let src = pattern(2 * ROWS * ROW + BIG, 7);
    let probes = [
        src[2 * ROWS * ROW + 300_000..][..64].to_vec(),
        src[2 * 17 * ROW + 100..][..64].to_vec(),
    ];
    let plain = move_batch(false);
    assert!(
        probes.iter().all(|p| contains(&plain, p)),
        "without encryption the payload crosses as it is (the probe is sound)"
    );
    let sealed = move_batch(true);
    for p in &probes {
        assert!(
            !contains(&sealed, p),
            "plaintext on the wire of an encrypted stream"
        );
    }
}

#[test]
fn a_sender_and_receiver_that_disagree_on_encryption_are_refused_naming_both() {
    for (rx_on, tx_on) in [(true, false), (false, true)] {
        let rx = agent(true, rx_on);
        let tx = agent(false, tx_on);
        let mut dst = vec![0u8; 8192];
        // SAFETY: dst outlives the agents' use of it.
        let _d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
        let addr = rx.local_addr().unwrap().to_string();
        let e = match connect(&tx, &addr) {
            Ok(_) => panic!("rx {rx_on}, tx {tx_on}: connected"),
            Err(e) => e,
        };
        assert_eq!(e.status(), Status::TransportUnavailable, "{e}");
        let on = |x: bool| if x { "on" } else { "off" };
        let want = format!(
            "the sender has it {}, this receiver {}",
            on(tx_on),
            on(rx_on)
        );
        assert!(e.to_string().contains(&want), "{e}");
        assert!(e.to_string().contains("PDXFER_TCP_ENCRYPT"), "{e}");
        drop(tx);
        drop(rx);
        assert!(dst.iter().all(|&b| b == 0));
    }
}

#[test]
fn a_bit_flipped_inside_an_encrypted_piece_fails_the_batch_and_writes_nothing() {
    let rx = agent(true, true);
    let tx = agent(false, true);
    let mut dst = vec![0u8; BIG];
    let mut src = pattern(BIG, 3);
    // SAFETY: both buffers outlive the agents' use of them (the agents drop first below).
    let d = unsafe { rx.register_host(dst.as_mut_ptr(), dst.len()) }.unwrap();
    // SAFETY: as above.
    let s = unsafe { tx.register_host(src.as_mut_ptr(), src.len()) }.unwrap();
    // connection 0 is the control connection, 1 the data stream: byte 4000
    // of it lies in the first piece's ciphertext (after the stream's auth
    // and Attach, a few hundred bytes)
    let (addr, _) = forwarder(rx.local_addr().unwrap().to_string(), Some((1, 4000)));
    let t = tx
        .connect(
            &addr,
            &ConnectOptions {
                transport: TransportKind::Tcp,
                streams: 1,
                timeout: Duration::from_secs(10),
                ..ConnectOptions::default()
            },
        )
        .unwrap();
    let op = WriteOp {
        local_region: s.id,
        local_offset: 0,
        remote_region: d.id,
        remote_offset: 0,
        len: BIG as u64,
    };
    let id = t.submit(&[op], &BatchOptions::default()).unwrap();
    let e = t.wait(id, Duration::from_secs(30)).unwrap_err();
    assert_eq!(e.status(), Status::ChannelIntegrity, "{e}");
    assert!(
        e.to_string().contains("failed its authentication tag"),
        "{e}"
    );
    assert!(
        rx.next_completion(Duration::from_millis(200)).is_none(),
        "the receiver delivered a tampered batch"
    );
    t.close();
    drop(tx);
    drop(rx);
    assert!(
        dst.iter().all(|&b| b == 0),
        "bytes written from a stream whose piece failed its tag"
    );
}
