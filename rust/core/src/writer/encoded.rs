//! What the compression workers hand to the I/O thread: records encoded into frames
//! ([`Encoded`]: the frame header and the payload's pieces, in file order) and the messages the
//! I/O thread takes ([`ToIo`]). Below both the workers (`encode.rs`) and the I/O side
//! (`io_thread.rs`, `batch.rs`, `direct.rs`), so that neither depends on the other.

use super::aligned::AlignedBuf;
use super::input::TensorInput;
use super::out_pool::PooledBuf;
use crate::error::Error;
use crate::format::{self, FrameHeader};
use crossbeam_channel::Sender;

/// Messages to the I/O thread.
pub(crate) enum ToIo {
    /// A worker encoded a record.
    Encoded(Encoded),
    /// A worker could not encode a record.
    Failed { raw_len: u64, error: Error },
    /// Answer `ack` once every record before `upto` is written (and synced, per policy: then
    /// the sync thread answers).
    Flush { upto: u64, ack: Sender<()> },
    /// Like `Flush`, then complete the open shard and stop.
    Close { upto: u64, ack: Sender<()> },
}

/// A record's stored payload.
pub(crate) enum Payload {
    /// Codec `none`: the blob header, then the caller's buffers as they are (no copy).
    Pieces {
        blob_header: Vec<u8>,
        tensors: Vec<TensorInput>,
    },
    /// The encoded payload (the caller's buffers are already released), in a buffer that goes
    /// back to the writer's pool when this is dropped.
    Owned(PooledBuf),
}

/// A record ready to be written: frame header and payload.
pub(crate) struct Encoded {
    pub seq: u64,
    pub header: FrameHeader,
    /// The encoded frame header, key and padding.
    pub head: Vec<u8>,
    pub payload: Payload,
}

/// Zero bytes for the padding after payloads.
pub(crate) static ZEROS: [u8; 8] = [0; 8];

impl Encoded {
    /// Bytes the frame takes in the file.
    pub fn frame_len(&self) -> u64 {
        self.header.frame_len()
    }

    /// Calls `f` with each piece of the frame, in file order: header, payload pieces, padding.
    pub fn for_each_piece(&self, mut f: impl FnMut(&[u8])) {
        f(&self.head);
        match &self.payload {
            Payload::Pieces {
                blob_header,
                tensors,
            } => {
                f(blob_header);
                for t in tensors {
                    f(t.data.bytes());
                }
            }
            Payload::Owned(bytes) => f(bytes),
        }
        let pad = (format::align8(self.header.stored_len) - self.header.stored_len) as usize;
        if pad > 0 {
            f(&ZEROS[..pad]);
        }
    }

    /// Copies the frame's bytes from offset `from` on into `out`, as many as fit before `out`
    /// holds `limit` bytes; returns how many were copied.
    pub fn copy_into(&self, from: u64, out: &mut AlignedBuf, limit: usize) -> usize {
        let mut skip = usize::try_from(from).unwrap_or(usize::MAX);
        let mut copied = 0;
        self.for_each_piece(|piece| {
            if skip >= piece.len() {
                skip -= piece.len();
                return;
            }
            let rest = &piece[skip..];
            skip = 0;
            let n = rest.len().min(limit.saturating_sub(out.len()));
            out.extend_from_slice(&rest[..n]);
            copied += n;
        });
        copied
    }

    /// Number of pieces [`Encoded::for_each_piece`] gives.
    pub fn piece_count(&self) -> usize {
        let payload = match &self.payload {
            Payload::Pieces { tensors, .. } => 1 + tensors.len(),
            Payload::Owned(_) => 1,
        };
        1 + payload + usize::from(!self.header.stored_len.is_multiple_of(8))
    }
}
