//! A record decoded with one of its tensors written straight into the caller's memory (a
//! training batch's row), the others into a small buffer of the record's own: the reader's
//! path for `layertap.torch`'s batches, which spares the decoded blob's allocation and the
//! batch's copy of it. The checks are those of [`decode_payload`](super::decode_payload).

use super::payload::{check_crc_on, check_key, check_ratio, PayloadInfo};
use crate::blob::{self, BlobHeader};
use crate::codec::{self, Codec};

/// Reusable buffers of one decoding thread: the decompressed blob of a `zstd` or `bp16-zstd`
/// record (kept from record to record, so that its pages are not allocated and faulted in for
/// each) and the zstd context; and the threads its record's large `exp-huf` blocks may spread
/// over.
#[derive(Default)]
pub struct Scratch {
    blob: Vec<u8>,
    dctx: Option<zstd::zstd_safe::DCtx<'static>>,
    /// Threads (this one among them; 0 counts as 1) that decode one `exp-huf` block coded by
    /// column: a batch with fewer records than threads gives each record the rest (a
    /// `bp16-zstd` or `zstd` record is one frame, decoded by one thread).
    pub(crate) threads: usize,
}

impl std::fmt::Debug for Scratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Scratch")
            .field("capacity", &self.blob.capacity())
            .finish_non_exhaustive()
    }
}

/// A record decoded by [`decode_placed`].
#[derive(Debug)]
pub struct Placed {
    /// The blob's header. The ranges of the tensors but the placed one index [`Placed::rest`];
    /// the placed one's range is empty (its bytes are in the caller's buffer).
    pub header: BlobHeader,
    /// The blob without the placed tensor's bytes (all of it when none was placed).
    pub rest: Vec<u8>,
    /// Which tensor (its position in `header.tensors`) was written into the caller's buffer:
    /// `None` when the record has no tensor of that name, or one longer than the buffer.
    pub placed: Option<usize>,
}

/// Decodes the record whose stored payload is `stored` (checked against its checksum unless
/// `info.payload_crc` is `None`, decoded, its header parsed and its key checked), writing the
/// data of its tensor `name` at the start of `dst` when it fits there, and zeros over the rest of
/// `dst` (a padded batch's row); `dst` is left as it is when the record has no such tensor, or a
/// longer one. `Err(reason)` says what is wrong with the payload; `dst` may then hold part of
/// the tensor.
pub fn decode_placed(
    stored: &[u8],
    info: &PayloadInfo<'_>,
    name: &str,
    dst: &mut [u8],
    scratch: &mut Scratch,
) -> Result<Placed, String> {
    if let Some(want) = info.payload_crc {
        check_crc_on(stored, want, scratch.threads.max(1))?;
    }
    check_ratio(stored.len(), info.raw_len)?;
    let raw_len = usize::try_from(info.raw_len).map_err(|_| "raw length too large".to_string())?;
    if info.codec == Codec::ExpHuf {
        return exphuf_placed(stored, info, name, dst, scratch.threads.max(1));
    }
    let blob: &[u8] = match info.codec {
        Codec::None => stored,
        _ => {
            codec::zstd_frame_into(stored, raw_len, &mut scratch.blob, &mut scratch.dctx)?;
            &scratch.blob
        }
    };
    codec::check_raw_len(blob.len(), info.raw_len)?;
    let header = check_key(info.key, blob::parse_header(blob)?)?;
    let planes = info.codec == Codec::Bp16Zstd;
    let (placed, dst) = target(&header, name, dst);
    let (header, mut rest) = split(header, placed, raw_len);
    for (i, t) in header.tensors.iter().enumerate() {
        let from = original(&header, i, placed, dst.len());
        let to = match placed {
            Some(p) if p == i => &mut *dst,
            _ => &mut rest[t.range.clone()],
        };
        if planes && t.spec.dtype.is_two_byte() {
            codec::join_planes(&blob[from], to);
        } else {
            to.copy_from_slice(&blob[from]);
        }
    }
    rest[..header.data_start].copy_from_slice(&blob[..header.data_start]);
    Ok(Placed {
        header,
        rest,
        placed,
    })
}

/// Decodes the whole blob of the record whose stored payload is `stored` into `out`, which
/// must be `info.raw_len` bytes long and is written in full (the header and every tensor's
/// data, which cover the blob: `blob::parse_header` checks), with the checks of
/// [`decode_placed`]; returns the blob's header. For [`ShardReader::read`](super::ShardReader::read)
/// into memory a dropped record left (no page to fault in, no copy of the planes). `Err(reason)`
/// says what is wrong with the payload; `out` may then hold part of the blob.
pub fn decode_into(
    stored: &[u8],
    info: &PayloadInfo<'_>,
    out: &mut [u8],
    scratch: &mut Scratch,
) -> Result<BlobHeader, String> {
    if let Some(want) = info.payload_crc {
        check_crc_on(stored, want, scratch.threads.max(1))?;
    }
    codec::check_raw_len(out.len(), info.raw_len)?;
    check_ratio(stored.len(), info.raw_len)?;
    match info.codec {
        Codec::ExpHuf => {
            let (header, head_len) = crate::exphuf::parse_head(stored, info.raw_len)?;
            let header = check_key(info.key, header)?;
            out[..head_len].copy_from_slice(&stored[..head_len]);
            let mut at = head_len;
            for t in &header.tensors {
                crate::exphuf::decode_tensor(
                    stored,
                    &mut at,
                    t,
                    &mut out[t.range.clone()],
                    scratch.threads.max(1),
                )?;
            }
            crate::exphuf::check_end(stored, at)?;
            Ok(header)
        }
        Codec::None => {
            let header = check_key(info.key, blob::parse_header(stored)?)?;
            out.copy_from_slice(stored);
            Ok(header)
        }
        Codec::Zstd => {
            codec::zstd_frame_into_slice(stored, out, &mut scratch.dctx)?;
            check_key(info.key, blob::parse_header(out)?)
        }
        Codec::Bp16Zstd => {
            // The planes go to the scratch buffer, then joined into `out`.
            codec::zstd_frame_into(stored, out.len(), &mut scratch.blob, &mut scratch.dctx)?;
            let blob = &scratch.blob;
            codec::check_raw_len(blob.len(), info.raw_len)?;
            let header = check_key(info.key, blob::parse_header(blob)?)?;
            codec::join_blob(blob, &header, out);
            Ok(header)
        }
    }
}

/// `exp-huf`: the header is stored as it is, and each tensor's block decodes straight into its
/// place.
fn exphuf_placed(
    stored: &[u8],
    info: &PayloadInfo<'_>,
    name: &str,
    dst: &mut [u8],
    threads: usize,
) -> Result<Placed, String> {
    let (header, head_len) = crate::exphuf::parse_head(stored, info.raw_len)?;
    let header = check_key(info.key, header)?;
    let (placed, dst) = target(&header, name, dst);
    let (header, mut rest) = split(header, placed, info.raw_len as usize);
    rest[..head_len].copy_from_slice(&stored[..head_len]);
    let mut at = head_len;
    for (i, t) in header.tensors.iter().enumerate() {
        let to = match placed {
            Some(p) if p == i => &mut *dst,
            _ => &mut rest[t.range.clone()],
        };
        crate::exphuf::decode_tensor(stored, &mut at, t, to, threads)?;
    }
    crate::exphuf::check_end(stored, at)?;
    Ok(Placed {
        header,
        rest,
        placed,
    })
}

/// The position of tensor `name` when its data fits in `dst`, and the part of `dst` it goes
/// to (the start), the rest of `dst` zeroed; `(None, [])` with `dst` untouched otherwise.
fn target<'d>(header: &BlobHeader, name: &str, dst: &'d mut [u8]) -> (Option<usize>, &'d mut [u8]) {
    let found = header
        .tensors
        .iter()
        .position(|t| t.spec.name == name && t.range.len() <= dst.len());
    match found {
        Some(p) => {
            let (to, pad) = dst.split_at_mut(header.tensors[p].range.len());
            pad.fill(0);
            (Some(p), to)
        }
        None => (None, &mut []),
    }
}

/// The header with the ranges of the tensors after the placed one moved down by its length and
/// its own range emptied, and a zeroed buffer for the rest of the blob.
fn split(mut header: BlobHeader, placed: Option<usize>, raw_len: usize) -> (BlobHeader, Vec<u8>) {
    let Some(p) = placed else {
        return (header, vec![0u8; raw_len]);
    };
    let gone = header.tensors[p].range.clone();
    for t in &mut header.tensors[p + 1..] {
        t.range = t.range.start - gone.len()..t.range.end - gone.len();
    }
    header.tensors[p].range = gone.start..gone.start;
    (header, vec![0u8; raw_len - gone.len()])
}

/// Tensor `i`'s range in the whole blob, from its range in the split header (tensors are in
/// the order of their data, so those after the placed one were moved down by its length).
fn original(
    header: &BlobHeader,
    i: usize,
    placed: Option<usize>,
    placed_len: usize,
) -> std::ops::Range<usize> {
    let r = header.tensors[i].range.clone();
    match placed {
        Some(p) if p == i => r.start..r.start + placed_len,
        Some(p) if i > p => r.start + placed_len..r.end + placed_len,
        _ => r,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blob::{build_header, TensorSpec};
    use crate::codec::Encoder;
    use crate::dtype::Dtype;
    use crate::format::crc32c;
    use std::collections::BTreeMap;

    /// A record of `tokens` tokens: `hidden_states` bf16 `[tokens, 2, 8]` between a token-id
    /// tensor before it and a loss mask after it (so that tensors on both sides are moved),
    /// and its stored payload in `codec`.
    fn record(codec: Codec, tokens: u64, seed: u8) -> (Vec<u8>, Vec<u8>) {
        let specs = vec![
            TensorSpec {
                name: "token_ids".into(),
                dtype: Dtype::I64,
                shape: vec![tokens],
            },
            TensorSpec {
                name: "hidden_states".into(),
                dtype: Dtype::BF16,
                shape: vec![tokens, 2, 8],
            },
            TensorSpec {
                name: "loss_mask".into(),
                dtype: Dtype::U8,
                shape: vec![tokens],
            },
        ];
        let meta = BTreeMap::from([("key".to_string(), format!("k{seed}"))]);
        let header = build_header(&specs, &meta).unwrap();
        let n = tokens as usize;
        let ids: Vec<u8> = (0..n * 8).map(|i| (i as u8).wrapping_mul(seed)).collect();
        // bf16 values of a few exponents, as activations have.
        let hidden: Vec<u8> = (0..n * 16)
            .flat_map(|i| {
                let v = half::bf16::from_f32(((i * 37 + seed as usize) % 101) as f32 / 7.0 - 5.0);
                v.to_bits().to_le_bytes()
            })
            .collect();
        let mask: Vec<u8> = (0..n).map(|i| (i % 3 == 0) as u8).collect();
        let raw = [&header[..], &ids, &hidden, &mask].concat();
        let stored = Encoder::new(codec, 3)
            .unwrap()
            .encode(
                &[&header, &ids, &hidden, &mask],
                &[false, false, true, false],
            )
            .unwrap();
        (raw, stored)
    }

    fn info<'a>(codec: Codec, raw: &[u8], stored: &[u8], key: &'a str) -> PayloadInfo<'a> {
        PayloadInfo {
            key,
            codec,
            raw_len: raw.len() as u64,
            payload_crc: Some(crc32c(stored)),
        }
    }

    /// Each tensor's bytes as the whole blob holds them, by name.
    fn tensors_of(raw: &[u8]) -> BTreeMap<String, Vec<u8>> {
        let h = blob::parse_header(raw).unwrap();
        h.tensors
            .iter()
            .map(|t| (t.spec.name.clone(), raw[t.range.clone()].to_vec()))
            .collect()
    }

    #[test]
    fn the_placed_tensor_and_the_rest_are_the_records_bytes_in_every_codec() {
        // One scratch for all: records of several lengths, longer and shorter in turn.
        let mut scratch = Scratch::default();
        for codec in Codec::ALL {
            for (seed, tokens) in [(1u8, 40u64), (2, 7), (3, 300), (4, 0)] {
                let (raw, stored) = record(codec, tokens, seed);
                let key = format!("k{seed}");
                let want = tensors_of(&raw);
                // A row 3 tokens longer than the record: zeros after it.
                let mut dst = vec![0xAAu8; want["hidden_states"].len() + 3 * 32];
                let got = decode_placed(
                    &stored,
                    &info(codec, &raw, &stored, &key),
                    "hidden_states",
                    &mut dst,
                    &mut scratch,
                )
                .unwrap();
                assert_eq!(got.placed, Some(1), "{codec} {tokens}");
                let (data, pad) = dst.split_at(want["hidden_states"].len());
                assert_eq!(data, want["hidden_states"], "{codec} {tokens}");
                assert!(pad.iter().all(|&b| b == 0), "{codec} {tokens}: zeros after");
                let full = blob::parse_header(&raw).unwrap();
                assert_eq!(got.header.metadata, full.metadata);
                assert_eq!(got.rest.len(), raw.len() - data.len());
                assert_eq!(got.rest[..full.data_start], raw[..full.data_start]);
                for t in &got.header.tensors {
                    if t.spec.name != "hidden_states" {
                        assert_eq!(got.rest[t.range.clone()], want[&t.spec.name], "{codec}");
                    }
                }
            }
        }
    }

    #[test]
    fn a_buffer_too_short_or_another_name_places_nothing() {
        let mut scratch = Scratch::default();
        for codec in Codec::ALL {
            let (raw, stored) = record(codec, 12, 5);
            for (name, len) in [("hidden_states", 12 * 32 - 2), ("no_such_tensor", 13 * 32)] {
                let mut dst = vec![7u8; len];
                let got = decode_placed(
                    &stored,
                    &info(codec, &raw, &stored, "k5"),
                    name,
                    &mut dst,
                    &mut scratch,
                )
                .unwrap();
                assert_eq!(got.placed, None);
                assert_eq!(got.rest, raw, "{codec}: the whole blob");
                assert_eq!(got.header, blob::parse_header(&raw).unwrap());
                assert!(dst.iter().all(|&b| b == 7), "{codec}: dst untouched");
            }
        }
    }

    #[test]
    fn damage_is_refused_with_the_reason_decode_payload_gives() {
        let mut scratch = Scratch::default();
        for codec in Codec::ALL {
            let (raw, stored) = record(codec, 20, 6);
            let mut dst = vec![0u8; 20 * 32];
            let mut check = |stored: &[u8], info: PayloadInfo<'_>| {
                let placed = decode_placed(stored, &info, "hidden_states", &mut dst, &mut scratch);
                let whole = super::super::decode_payload(stored, &info);
                assert!(placed.is_err(), "{codec}");
                assert_eq!(placed.err(), whole.err(), "{codec}");
            };
            let mut flipped = stored.clone();
            let last = flipped.len() - 1;
            flipped[last] ^= 0x10;
            check(&flipped, info(codec, &raw, &stored, "k6")); // checksum
            let unchecked = PayloadInfo {
                payload_crc: None,
                ..info(codec, &raw, &flipped, "k6")
            };
            check(&stored[..stored.len() - 3], unchecked); // cut
            check(&stored, info(codec, &raw, &stored, "another key"));
            let longer = PayloadInfo {
                raw_len: raw.len() as u64 + 8,
                ..info(codec, &raw, &stored, "k6")
            };
            check(&stored, longer);
        }
    }
}
