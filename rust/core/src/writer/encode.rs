//! The compression workers (`layertap-zstd-N` threads): each takes checked records, encodes
//! the payload (or, for codec `none`, only checksums the caller's buffers) into a buffer of the
//! writer's [`OutPool`], builds the frame header, and hands the result to the I/O thread.

use super::encoded::{Encoded, Payload, ToIo};
use super::input::Prepared;
use super::lossy;
use super::out_pool::OutPool;
use super::state::Shared;
use crate::codec::{Codec, Encoder};
use crate::error::Result;
use crate::format::{self, FrameHeader, FrameKind};
use crossbeam_channel::{Receiver, Sender};
use std::sync::Arc;
use std::time::Instant;

/// A record queued for a worker.
pub(crate) struct Job {
    pub seq: u64,
    pub rec: Prepared,
}

/// The body of a worker thread: encodes jobs until the job channel closes.
pub(crate) fn run_worker(
    codec: Codec,
    level: i32,
    jobs: Receiver<Job>,
    to_io: Sender<ToIo>,
    shared: &Shared,
    pool: &Arc<OutPool>,
) {
    let mut encoder = Encoder::new(codec, level);
    for mut job in &jobs {
        // What the record took from the budget; the lossy stage may change its length.
        let raw_len = job.rec.raw_len;
        let started = Instant::now();
        let result = match encoder.as_mut() {
            // A panic must not lose the record silently: the I/O thread waits for every seq.
            Ok(enc) => std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                lossy::apply(&mut job.rec, pool)?;
                encode(enc, job, pool)
            }))
            .unwrap_or_else(|_| Err(codec_error(codec, "encoder panicked".into()))),
            Err(e) => Err(codec_error(codec, e.to_string())),
        };
        shared.add_encode_time(started.elapsed());
        let msg = match result {
            Ok(encoded) => {
                // Its frame's length is what the I/O side frees once it is written.
                shared.readmit(raw_len, encoded.header.raw_len);
                ToIo::Encoded(encoded)
            }
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

fn encode(enc: &mut Encoder, job: Job, pool: &Arc<OutPool>) -> Result<Encoded> {
    let Prepared {
        key,
        blob_header,
        tensors,
        two_byte,
        num_tokens,
        raw_len,
        lossy: _, // applied by now
        encoded_len,
    } = job.rec;
    let codec = enc.codec();
    // Codec `none`, or a record whose floating tensors came as exp-huf blocks (checked at
    // submission): the payload is the blob header and the caller's buffers as they are.
    let (payload, stored_len, payload_crc) = if codec == Codec::None || encoded_len.is_some() {
        let mut crc = format::crc32c(&blob_header);
        for t in &tensors {
            crc = format::crc32c_append(crc, t.data.bytes());
        }
        (
            Payload::Pieces {
                blob_header,
                tensors,
            },
            encoded_len.unwrap_or(raw_len),
            crc,
        )
    } else {
        let mut pieces: Vec<&[u8]> = Vec::with_capacity(1 + tensors.len());
        pieces.push(&blob_header);
        pieces.extend(tensors.iter().map(|t| t.data.bytes()));
        let mut flags = Vec::with_capacity(pieces.len());
        flags.push(false);
        flags.extend_from_slice(&two_byte);
        let total = pieces.iter().map(|p| p.len()).sum();
        let mut out = pool.take(enc.out_capacity(total));
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
