//! TCP: several data streams per peer plus the control connection.
//!
//! The sender writes each piece as a 48-byte header followed by the bytes
//! with `writev` (many pieces per call, partial writes resumed): consecutive
//! ops whose destinations follow each other are one piece, its payload
//! gathered from their sources (short ones through the stream's small,
//! cache-resident gather buffer, long ones straight from registered memory). The receiver reads through a buffer per
//! stream (one `read` brings many headers and small payloads, copied from
//! it), validates each destination against its registry, and reads a payload
//! not all buffered straight into its destination with `readv` (an invalid
//! destination is drained: nothing is written). Pieces cost no lock: a
//! stream keeps the region of its pieces pinned across a run of buffered
//! pieces and merges its byte counts into the session's batches before it
//! waits on its socket.
//! A destination in device memory (a region registered with a
//! [`DeviceWriter`](crate::memory::DeviceWriter)) is read into the stream's
//! bounded bounce buffer (page-locked where the writer can allocate it) and
//! copied to the device slice by slice, double-buffered: the buffer's two
//! halves alternate, the asynchronous copy of one slice running while the
//! next is read from the socket into the other half (a half is reused only
//! after its copy was waited); the piece counts only once every copy was
//! waited, and its checksum is computed on the bytes received.
//! After its last piece, the last stream of a batch sends the commit record
//! on the control connection; the receiver delivers the completion once all
//! bytes counted across streams have landed and answers Ack (or Nack with
//! the reason). A dead peer resets the sockets: every pending batch fails
//! with the reason, never hangs (write timeouts and batch deadlines bound a
//! stalled one).

//!
//! - `send`: the sender ([`TcpTransport`]) and its setup on a dialed control
//!   connection (the data streams attach to the receiver's session);
//! - `recv`: the receiver: data streams, batch accounting, the verdict on commit;
//! - `inbuf`: a data stream's receive buffer and the pin timeout of payload reads;
//! - `device`: the receiver's landing of a piece in device memory;
//! - `seal`: encrypted pieces (the agent's `tcp_encrypt` option).

mod device;
#[cfg(test)]
mod device_tests;
mod inbuf;
mod recv;
mod seal;
mod send;

#[cfg(test)]
pub(crate) use device::DEVICE_BOUNCE_BYTES;
pub(crate) use recv::{finalize_tcp, serve_stream, TcpRecv};
pub(crate) use send::connect;
pub use send::TcpTransport;
