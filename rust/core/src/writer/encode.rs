//! The compression workers (`layertap-zstd-N` threads): each takes checked records, encodes
//! the payload (or, for codec `none`, only checksums the caller's buffers), builds the frame
//! header, and hands the result to the I/O thread.

use super::aligned::AlignedBuf;
use super::input::{Prepared, TensorInput};
use super::io_thread::ToIo;
use super::state::Shared;
use crate::codec::{Codec, Encoder};
use crate::error::Result;
use crate::format::{self, FrameHeader, FrameKind};
use crossbeam_channel::{Receiver, Sender};
use std::time::Instant;

/// A record queued for a worker.
pub(crate) struct Job {
    pub seq: u64,
    pub rec: Prepared,
}

/// A record's stored payload.
pub(crate) enum Payload {
    /// Codec `none`: the blob header, then the caller's buffers as they are (no copy).
    Pieces {
        blob_header: Vec<u8>,
        tensors: Vec<TensorInput>,
    },
    /// The encoded payload (the caller's buffers are already released).
    Owned(Vec<u8>),
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

/// The body of a worker thread: encodes jobs until the job channel closes.
pub(crate) fn run_worker(
    codec: Codec,
    level: i32,
    jobs: Receiver<Job>,
    to_io: Sender<ToIo>,
    shared: &Shared,
) {
    let mut encoder = Encoder::new(codec, level);
    for job in &jobs {
        let raw_len = job.rec.raw_len;
        let started = Instant::now();
        let result = match encoder.as_mut() {
            // A panic must not lose the record silently: the I/O thread waits for every seq.
            Ok(enc) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| encode(enc, job)))
                .unwrap_or_else(|_| Err(codec_error(codec, "encoder panicked".into()))),
            Err(e) => Err(codec_error(codec, e.to_string())),
        };
        shared.add_encode_time(started.elapsed());
        let msg = match result {
            Ok(encoded) => ToIo::Encoded(encoded),
            Err(error) => ToIo::Failed { raw_len, error },
        };
        if to_io.send(msg).is_err() {
            return; // the I/O thread is gone; the writer is being torn down
        }
    }
}

fn codec_error(codec: Codec, reason: String) -> crate::Error {
    crate::Error::Codec {
        codec: codec.name(),
        reason,
    }
}

fn encode(enc: &mut Encoder, job: Job) -> Result<Encoded> {
    let Prepared {
        key,
        blob_header,
        tensors,
        two_byte,
        num_tokens,
        raw_len,
    } = job.rec;
    let codec = enc.codec();
    let (payload, stored_len, payload_crc) = if codec == Codec::None {
        let mut crc = format::crc32c(&blob_header);
        for t in &tensors {
            crc = format::crc32c_append(crc, t.data.bytes());
        }
        (
            Payload::Pieces {
                blob_header,
                tensors,
            },
            raw_len,
            crc,
        )
    } else {
        let mut pieces: Vec<&[u8]> = Vec::with_capacity(1 + tensors.len());
        pieces.push(&blob_header);
        pieces.extend(tensors.iter().map(|t| t.data.bytes()));
        let mut flags = Vec::with_capacity(pieces.len());
        flags.push(false);
        flags.extend_from_slice(&two_byte);
        let mut out = Vec::new();
        enc.encode_into(&pieces, &flags, &mut out)?;
        drop(pieces);
        drop(tensors); // the caller's buffers are no longer needed
        let crc = format::crc32c(&out);
        let len = out.len() as u64;
        (Payload::Owned(out), len, crc)
    };
    let header = FrameHeader {
        kind: FrameKind::Record,
        codec,
        key,
        stored_len,
        raw_len,
        num_tokens,
        payload_crc,
    };
    let head = header.encode();
    Ok(Encoded {
        seq: job.seq,
        header,
        head,
        payload,
    })
}
