//! The engine's rank-to-rank control channel: versioned JSON messages, one per
//! line, over TCP (decode connects to the prefill rank's `ctl` endpoint).
//!
//! Unlike SGLang's positional ZMQ frames, every message is named and typed,
//! carries the sender's instance id and epoch, and the first exchange
//! re-checks what the bootstrap advertised (`bootstrap::peer::verify_peer`).

use crate::bootstrap::schema::PeerHello;
use crate::error::{Error, Result, Status};
use serde::{Deserialize, Serialize};
use std::io::{BufRead, BufReader, Write};
use std::net::TcpStream;
use std::sync::Mutex;

/// Version of the control protocol; a peer with another version is refused.
pub const CONTROL_VERSION: u32 = 1;
/// Largest accepted control line (a page list of a very long request fits).
pub const MAX_LINE: usize = 64 << 20;

/// Where the decode rank's regions are, by purpose.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct RegionMap {
    /// (layer id, region id of that KV entry's pool). A list, not a map:
    /// internally tagged messages cannot carry integer map keys in JSON.
    pub kv: Vec<(u32, u64)>,
    /// Per aux buffer: (region id, item bytes).
    pub aux: Vec<(u64, u64)>,
    /// Per state buffer: (region id, item bytes).
    #[serde(default)]
    pub state: Vec<(u64, u64)>,
}

impl RegionMap {
    /// The region holding layer `layer`'s pool.
    pub fn kv_region(&self, layer: u32) -> Option<u64> {
        self.kv.iter().find(|(l, _)| *l == layer).map(|(_, r)| *r)
    }
}

/// One control message.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum CtlMsg {
    /// Decode -> prefill, first message: who I am and where my data goes.
    Hello {
        /// Protocol version.
        version: u32,
        /// The decode rank's self-description (instance id, epoch, topology).
        hello: PeerHello,
        /// The decode agent's data address (the prefill connects to it).
        data_addr: String,
        /// The decode rank's regions by purpose.
        regions: RegionMap,
    },
    /// Prefill -> decode: the answer to Hello.
    HelloAck {
        /// Protocol version.
        version: u32,
        /// The prefill rank's self-description.
        hello: PeerHello,
    },
    /// Decode -> prefill, per room: where the request's KV goes.
    Meta {
        /// Room id.
        room: u64,
        /// The decode room's attempt (echoed in status messages).
        attempt: u64,
        /// Destination (virtual) page ids after the decode prefix.
        dst_pages: Vec<u64>,
        /// Tokens the decode side already holds.
        decode_prefix_len: u64,
        /// Row of the decode aux buffers for this request.
        aux_index: u64,
        /// Row of each decode state buffer for this request (empty: no state).
        #[serde(default)]
        state_indices: Vec<u64>,
        /// How many decode ranks the prefill rank waits for in this room.
        required_dst_info_num: u32,
        /// Room deadline in milliseconds (0: the prefill's default).
        timeout_ms: u64,
    },
    /// Decode -> prefill: give up the room.
    Abort {
        /// Room id.
        room: u64,
        /// The decode room's attempt.
        attempt: u64,
    },
    /// Prefill -> decode: the room ended on this prefill rank.
    Status {
        /// Room id.
        room: u64,
        /// The decode room's attempt this answers.
        attempt: u64,
        /// True when every byte landed and was acknowledged.
        ok: bool,
        /// SGLang's prefill_unique_rank of the sender.
        prefill_rank: u32,
        /// Bytes written for this decode rank.
        bytes: u64,
        /// Failure reason, when not ok.
        reason: Option<String>,
        /// Stable status code of the failure, when not ok.
        code: Option<i32>,
    },
    /// Prefill -> decode: the abort is fenced (no write for the room can still land).
    AbortAck {
        /// Room id.
        room: u64,
        /// The decode room's attempt.
        attempt: u64,
    },
}

/// A framed control connection (one writer lock; one reader thread owns the reader).
#[derive(Debug)]
pub struct CtlWriter {
    stream: Mutex<TcpStream>,
}

impl CtlWriter {
    /// Wraps the write half.
    pub fn new(stream: TcpStream) -> CtlWriter {
        CtlWriter {
            stream: Mutex::new(stream),
        }
    }

    /// Sends one message.
    pub fn send(&self, m: &CtlMsg) -> Result<()> {
        let mut line =
            serde_json::to_vec(m).map_err(|e| Error::new(Status::Protocol, e.to_string()))?;
        line.push(b'\n');
        let mut s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        s.write_all(&line)?;
        Ok(())
    }

    /// Closes both directions (wakes the reader).
    pub fn shutdown(&self) {
        let s = self.stream.lock().unwrap_or_else(|p| p.into_inner());
        let _ = s.shutdown(std::net::Shutdown::Both);
    }
}

/// Reads framed messages.
pub struct CtlReader {
    r: BufReader<TcpStream>,
    buf: Vec<u8>,
}

impl CtlReader {
    /// Wraps the read half.
    pub fn new(stream: TcpStream) -> CtlReader {
        CtlReader {
            r: BufReader::new(stream),
            buf: Vec::new(),
        }
    }

    /// The next message; `Ok(None)` at a clean end of stream.
    pub fn recv(&mut self) -> Result<Option<CtlMsg>> {
        self.buf.clear();
        let n = (&mut self.r)
            .take(MAX_LINE as u64 + 1)
            .read_until(b'\n', &mut self.buf)?;
        if n == 0 {
            return Ok(None);
        }
        if self.buf.last() != Some(&b'\n') {
            return Err(Error::new(
                Status::Protocol,
                if n > MAX_LINE {
                    format!("control message longer than {MAX_LINE} bytes")
                } else {
                    "control connection closed in the middle of a message".to_string()
                },
            ));
        }
        decode_line(&self.buf[..n - 1]).map(Some)
    }
}

/// One control message from its line (without the `\n`).
pub fn decode_line(line: &[u8]) -> Result<CtlMsg> {
    serde_json::from_slice(line)
        .map_err(|e| Error::new(Status::Protocol, format!("malformed control message: {e}")))
}

use std::io::Read as _;

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;

    #[test]
    fn roundtrip_and_malformed() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let t = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut r = CtlReader::new(s.try_clone().unwrap());
            let a = r.recv().unwrap().unwrap();
            let b = r.recv();
            (a, b.map_err(|e| e.status()))
        });
        let s = TcpStream::connect(addr).unwrap();
        let w = CtlWriter::new(s.try_clone().unwrap());
        let m = CtlMsg::Abort {
            room: 7,
            attempt: 2,
        };
        w.send(&m).unwrap();
        let mut raw = s;
        raw.write_all(b"{\"type\":\"nope\"}\n").unwrap();
        let (a, b) = t.join().unwrap();
        assert_eq!(a, m);
        assert_eq!(b.unwrap_err(), Status::Protocol);
    }
}
