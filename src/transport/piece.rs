//! [`Piece`]: one op of a batch after validation against the peer's
//! regions, what every transport's sender moves and what a room admits.

/// One op after validation: absolute source address, destination region,
/// offset and absolute destination address in the peer.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Piece {
    pub src: u64,
    pub region: u64,
    pub offset: u64,
    pub dst: u64,
    pub len: u64,
}
