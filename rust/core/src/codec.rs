//! Payload codecs (docs/FORMAT.md, "Codecs"): `none`, `zstd`, `bp16-zstd`, which splits
//! 2-byte elements into a high-byte plane and a low-byte plane before zstd, and `exp-huf`
//! (module [`crate::exphuf`]), which Huffman-codes the exponents of floating tensors.

use crate::blob;
use crate::error::{Error, Result};
/// The codec ids and names are part of the format (docs/FORMAT.md, "Codecs"); this module holds
/// what each codec does.
pub use crate::format::Codec;

/// The zstd levels the library takes.
pub fn level_range() -> std::ops::RangeInclusive<i32> {
    zstd::compression_level_range()
}

/// Checks a zstd level.
pub fn check_level(level: i32) -> Result<()> {
    let range = level_range();
    if !range.contains(&level) {
        return Err(Error::invalid(format!(
            "zstd level {level} is out of range {}..={}",
            range.start(),
            range.end()
        )));
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Byte planes (module [`crate::byte_planes`])

use crate::byte_planes::extract_plane;
pub use crate::byte_planes::{join_planes, split_planes};

// ---------------------------------------------------------------------------------------------
// Encoding

/// Elements split into planes per step of [`Encoder::encode`]: the plane buffer stays small
/// (and in cache) however large the tensor is.
const PLANE_CHUNK_ELEMS: usize = 64 << 10;

/// zstd parameters of `bp16-zstd` at level 1 (the default), instead of zstd's own level 1. The
/// high-byte plane of bf16 activations is a stream of few distinct symbols with short, rare
/// repeats: skipping matches shorter than 7 bytes and keeping a small hash table leaves it to
/// the entropy coder, which compresses it as well or better (1.459x against 1.445x for the whole
/// record on all-MiniLM-L6-v2 activations) about 1.8 times faster. The same set is used by the
/// Python writer (`layertap/_py/codecs.py`); benches/README.md has the measurements.
const BYTE_PLANE_LEVEL_1: [zstd::zstd_safe::CParameter; 5] = {
    use zstd::zstd_safe::{CParameter as P, Strategy};
    [
        P::Strategy(Strategy::ZSTD_fast),
        P::WindowLog(17),
        P::HashLog(8),
        P::MinMatch(7),
        P::TargetLength(0),
    ]
};

/// A compressor that keeps its zstd context between records (one per worker thread).
///
/// It streams the pieces of a blob into one zstd frame, so the caller's buffers are read once
/// and never copied into a whole-record scratch buffer; `bp16-zstd` splits the byte planes of
/// 2-byte tensors chunk by chunk into a small buffer on the way.
pub struct Encoder {
    codec: Codec,
    zstd: Option<zstd::zstd_safe::CCtx<'static>>,
    plane: Vec<u8>,
}

impl Encoder {
    /// An encoder for `codec` at zstd `level` (ignored by `none` and `exp-huf`).
    pub fn new(codec: Codec, level: i32) -> Result<Encoder> {
        use zstd::zstd_safe::CParameter;
        let zstd = match codec {
            Codec::None | Codec::ExpHuf => None,
            _ => {
                check_level(level)?;
                let mut c = zstd::zstd_safe::CCtx::try_create()
                    .ok_or_else(|| codec_err(codec, "cannot allocate a zstd context"))?;
                for p in [
                    CParameter::CompressionLevel(level),
                    CParameter::ContentSizeFlag(true),
                    CParameter::ChecksumFlag(false),
                ] {
                    c.set_parameter(p).map_err(|e| zstd_err(codec, e))?;
                }
                if codec == Codec::Bp16Zstd && level == 1 {
                    for p in BYTE_PLANE_LEVEL_1 {
                        c.set_parameter(p).map_err(|e| zstd_err(codec, e))?;
                    }
                }
                Some(c)
            }
        };
        Ok(Encoder {
            codec,
            zstd,
            plane: Vec::new(),
        })
    }

    /// The codec.
    pub fn codec(&self) -> Codec {
        self.codec
    }

    /// Capacity an output buffer needs for [`Encoder::encode_into`] to encode `total` bytes
    /// into it without growing it: what a caller that recycles buffers asks for.
    pub fn out_capacity(&self, total: usize) -> usize {
        match self.codec {
            Codec::None => total,
            Codec::ExpHuf => crate::exphuf::out_capacity(total),
            // zstd's bound, plus the room `feed` and `finish` keep free before each call (else
            // a payload that nears the bound would double the buffer for its last bytes).
            Codec::Zstd | Codec::Bp16Zstd => zstd::zstd_safe::compress_bound(total) + OUT_STEP,
        }
    }

    /// Encodes a blob given as pieces (its header, then each tensor's bytes): returns the stored
    /// payload. For `none` this concatenates; callers that can write the pieces directly should
    /// do so instead. `two_byte` lists, for each piece, whether it is a 2-byte tensor (the header
    /// piece is `false`).
    pub fn encode(&mut self, pieces: &[&[u8]], two_byte: &[bool]) -> Result<Vec<u8>> {
        let mut out = Vec::new();
        self.encode_into(pieces, two_byte, &mut out)?;
        Ok(out)
    }

    /// Like [`Encoder::encode`], writing the payload into `out` (cleared first), whose
    /// allocation is reused: it grows only if its capacity is less than
    /// [`Encoder::out_capacity`] (`reserve_exact` reallocates only then).
    pub fn encode_into(
        &mut self,
        pieces: &[&[u8]],
        two_byte: &[bool],
        out: &mut Vec<u8>,
    ) -> Result<()> {
        out.clear();
        let total: usize = pieces.iter().map(|p| p.len()).sum();
        let capacity = self.out_capacity(total);
        let codec = self.codec;
        if codec == Codec::ExpHuf {
            return crate::exphuf::encode(pieces, out).map_err(|e| codec_err(codec, e));
        }
        let Some(cctx) = self.zstd.as_mut() else {
            out.reserve_exact(capacity);
            for p in pieces {
                out.extend_from_slice(p);
            }
            return Ok(());
        };
        cctx.reset(zstd::zstd_safe::ResetDirective::SessionOnly)
            .map_err(|e| zstd_err(codec, e))?;
        cctx.set_pledged_src_size(Some(total as u64))
            .map_err(|e| zstd_err(codec, e))?;
        out.reserve_exact(capacity);
        for (i, piece) in pieces.iter().enumerate() {
            let split = codec == Codec::Bp16Zstd && two_byte.get(i).copied().unwrap_or(false);
            if !split || piece.len() % 2 != 0 {
                feed(cctx, piece, out).map_err(|e| zstd_err(codec, e))?;
                continue;
            }
            // High plane (odd bytes) first, then the low plane (even bytes).
            for odd in [1usize, 0] {
                for chunk in piece.chunks(2 * PLANE_CHUNK_ELEMS) {
                    self.plane.resize(chunk.len() / 2, 0);
                    extract_plane(chunk, odd, &mut self.plane);
                    feed(cctx, &self.plane, out).map_err(|e| zstd_err(codec, e))?;
                }
            }
        }
        finish(cctx, out).map_err(|e| zstd_err(codec, e))
    }
}

/// Room kept free at the end of the output for each streaming call.
const OUT_STEP: usize = 1 << 16;

fn feed(
    cctx: &mut zstd::zstd_safe::CCtx<'static>,
    data: &[u8],
    out: &mut Vec<u8>,
) -> std::result::Result<(), usize> {
    use zstd::zstd_safe::{zstd_sys::ZSTD_EndDirective, InBuffer, OutBuffer};
    let mut input = InBuffer::around(data);
    while input.pos() < data.len() {
        if out.capacity() - out.len() < OUT_STEP {
            out.reserve(OUT_STEP);
        }
        let pos = out.len();
        let mut output = OutBuffer::around_pos(out, pos);
        cctx.compress_stream2(&mut output, &mut input, ZSTD_EndDirective::ZSTD_e_continue)?;
    }
    Ok(())
}

fn finish(
    cctx: &mut zstd::zstd_safe::CCtx<'static>,
    out: &mut Vec<u8>,
) -> std::result::Result<(), usize> {
    use zstd::zstd_safe::{zstd_sys::ZSTD_EndDirective, InBuffer, OutBuffer};
    loop {
        if out.capacity() - out.len() < OUT_STEP {
            out.reserve(OUT_STEP);
        }
        let pos = out.len();
        let mut output = OutBuffer::around_pos(out, pos);
        let left = cctx.compress_stream2(
            &mut output,
            &mut InBuffer::around(&[]),
            ZSTD_EndDirective::ZSTD_e_end,
        )?;
        if left == 0 {
            return Ok(());
        }
    }
}

fn zstd_err(codec: Codec, code: usize) -> Error {
    codec_err(codec, zstd::zstd_safe::get_error_name(code))
}

fn codec_err(codec: Codec, e: impl std::fmt::Display) -> Error {
    Error::Codec {
        codec: codec.name(),
        reason: e.to_string(),
    }
}

// ---------------------------------------------------------------------------------------------
// Decoding

/// A decoded payload: the raw blob and its parsed, checked safetensors header.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Decoded {
    /// The safetensors blob, `raw_len` bytes.
    pub blob: Vec<u8>,
    /// Its header, parsed once here (`bp16-zstd` needs it to join the byte planes back), so
    /// that readers need not parse it again.
    pub header: blob::BlobHeader,
}

/// Decodes a stored payload into the raw blob of `raw_len` bytes and parses the blob's header.
/// `Err(reason)` says why the payload cannot be decoded or is not a valid blob.
pub fn decode(codec: Codec, stored: &[u8], raw_len: u64) -> std::result::Result<Decoded, String> {
    let raw_len = usize::try_from(raw_len).map_err(|_| "raw length too large".to_string())?;
    let decoded = match codec {
        Codec::None => stored.to_vec(),
        Codec::ExpHuf => crate::exphuf::decode(stored, raw_len as u64)?,
        Codec::Zstd | Codec::Bp16Zstd => zstd_frame(stored, raw_len)?,
    };
    check_raw_len(decoded.len(), raw_len as u64)?;
    // The header is not transformed (only tensor data is split into planes), so it parses the
    // same before and after the planes are joined.
    let header = blob::parse_header(&decoded)?;
    if codec != Codec::Bp16Zstd {
        return Ok(Decoded {
            blob: decoded,
            header,
        });
    }
    let mut out = vec![0u8; raw_len];
    join_blob(&decoded, &header, &mut out);
    Ok(Decoded { blob: out, header })
}

/// Writes the blob whose `bp16-zstd` form (16-bit tensors split into planes) is `planes`, with
/// its parsed `header`, into `out` (as long as `planes`): the header and the other tensors as
/// they are, each 16-bit tensor's planes joined.
pub(crate) fn join_blob(planes: &[u8], header: &blob::BlobHeader, out: &mut [u8]) {
    out[..header.data_start].copy_from_slice(&planes[..header.data_start]);
    for t in &header.tensors {
        let (from, to) = (&planes[t.range.clone()], &mut out[t.range.clone()]);
        if t.spec.dtype.is_two_byte() {
            join_planes(from, to);
        } else {
            to.copy_from_slice(from);
        }
    }
}

/// Checks that a decoded payload's length is what the frame promised.
pub fn check_raw_len(got: usize, want: u64) -> Result<(), String> {
    if got as u64 != want {
        return Err(format!("decoded {got} bytes, frame says {want}"));
    }
    Ok(())
}

/// First bytes of a zstd frame (RFC 8878, 3.1.1), little-endian `0xFD2FB528`.
const ZSTD_MAGIC: [u8; 4] = [0x28, 0xB5, 0x2F, 0xFD];
/// The largest window a stored zstd frame may ask for (docs/FORMAT.md): libzstd's default
/// decoding limit (`ZSTD_WINDOWLOG_LIMIT_DEFAULT`, 2^27), which streaming decoders (the Python
/// reader's among them) enforce; this reader decodes in one call, which needs no window, so it
/// checks the limit itself and both readers refuse the same frames. No writer at any level asks
/// for more.
pub const ZSTD_MAX_WINDOW: u64 = 1 << 27;

/// The window size a zstd frame's header asks for (RFC 8878, 3.1.1.1.2): its window
/// descriptor's, or for a single-segment frame its content size. `stored` is a frame whose
/// length [`zstd_safe::find_frame_compressed_size`] found, so its header is whole.
fn zstd_window_size(stored: &[u8]) -> u64 {
    let fhd = stored[4];
    if fhd & 0x20 == 0 {
        let wd = stored[5];
        let base = 1u64 << (10 + (wd >> 3));
        return base + (base >> 3) * (wd & 7) as u64;
    }
    // Single segment: after the descriptor, the dictionary id (0, 1, 2 or 4 bytes), then the
    // content size (1, 2, 4 or 8 bytes; a 2-byte one is stored less 256).
    let at = 5 + [0, 1, 2, 4][(fhd & 3) as usize];
    let len = [1, 2, 4, 8][(fhd >> 6) as usize];
    let mut field = [0u8; 8];
    field[..len].copy_from_slice(&stored[at..at + len]);
    u64::from_le_bytes(field) + if len == 2 { 256 } else { 0 }
}

/// Decodes `stored`, which must be exactly one zstd frame, into at most `raw_len` bytes.
///
/// A frame may omit its content size (streaming compressors, `zstd` reading a pipe): then the
/// output is bounded by `raw_len` instead, and a frame that decodes to more is corrupt. Either
/// way the output buffer is `raw_len` bytes, which the reader has bounded by the stored length
/// (`ZSTD_MAX_RATIO`), and is decoded into in one call, so the decoder allocates no window of the
/// size the frame header asks for.
fn zstd_frame(stored: &[u8], raw_len: usize) -> std::result::Result<Vec<u8>, String> {
    let mut out = Vec::new();
    let mut dctx = None;
    zstd_frame_into(stored, raw_len, &mut out, &mut dctx)?;
    Ok(out)
}

/// [`zstd_frame`] into `out` (cleared first; its capacity is kept, so a buffer reused from
/// record to record is not allocated and faulted in again), with the decompression context
/// `dctx` (made at the first call, then reused).
pub(crate) fn zstd_frame_into(
    stored: &[u8],
    raw_len: usize,
    out: &mut Vec<u8>,
    dctx: &mut Option<zstd::zstd_safe::DCtx<'static>>,
) -> std::result::Result<(), String> {
    out.clear();
    let declared = check_zstd_frame(stored, raw_len)?;
    out.try_reserve_exact(raw_len)
        .map_err(|_| format!("cannot allocate {raw_len} bytes to decode the payload into"))?;
    // `decompress` writes into the spare capacity (at least `raw_len` bytes, more when the
    // buffer held a longer record before) and sets the length.
    match zstd_context(dctx)?.decompress(out, stored) {
        Ok(_) if out.len() > raw_len => Err(too_long(raw_len)),
        Ok(_) => Ok(()),
        Err(code) => Err(zstd_error(code, declared, raw_len)),
    }
}

/// [`zstd_frame`] into `out`, which must be as long as the frame's content: exactly the
/// decoded payload's `raw_len` bytes.
pub(crate) fn zstd_frame_into_slice(
    stored: &[u8],
    out: &mut [u8],
    dctx: &mut Option<zstd::zstd_safe::DCtx<'static>>,
) -> std::result::Result<(), String> {
    let raw_len = out.len();
    let declared = check_zstd_frame(stored, raw_len)?;
    match zstd_context(dctx)?.decompress(out, stored) {
        Ok(n) => check_raw_len(n, raw_len as u64),
        Err(code) => Err(zstd_error(code, declared, raw_len)),
    }
}

/// The checks of a stored zstd frame before it is decoded into `raw_len` bytes: one whole frame
/// and nothing after it, a window no larger than [`ZSTD_MAX_WINDOW`], a content size (when the
/// frame says one) of `raw_len`. Returns that content size.
fn check_zstd_frame(stored: &[u8], raw_len: usize) -> std::result::Result<Option<u64>, String> {
    use zstd::zstd_safe;
    if !stored.starts_with(&ZSTD_MAGIC) {
        return Err("payload is not a zstd frame".into());
    }
    let frame_len = zstd_safe::find_frame_compressed_size(stored)
        .map_err(|code| format!("zstd frame: {}", zstd_safe::get_error_name(code)))?;
    if frame_len != stored.len() {
        return Err(format!(
            "{} bytes after the zstd frame",
            stored.len() - frame_len
        ));
    }
    let window = zstd_window_size(stored);
    if window > ZSTD_MAX_WINDOW {
        return Err(format!(
            "zstd frame asks for a window of {window} bytes, more than {ZSTD_MAX_WINDOW}"
        ));
    }
    let Ok(declared) = zstd_safe::get_frame_content_size(stored) else {
        return Err("payload is not a zstd frame".into());
    };
    if let Some(n) = declared {
        if n != raw_len as u64 {
            return Err(format!(
                "zstd frame holds {n} bytes, frame header says {raw_len}"
            ));
        }
    }
    Ok(declared)
}

/// The decompression context in `dctx`, made at the first call.
fn zstd_context<'d>(
    dctx: &'d mut Option<zstd::zstd_safe::DCtx<'static>>,
) -> std::result::Result<&'d mut zstd::zstd_safe::DCtx<'static>, String> {
    if dctx.is_none() {
        *dctx = Some(zstd::zstd_safe::DCtx::try_create().ok_or("cannot allocate a zstd context")?);
    }
    Ok(dctx.as_mut().expect("made above"))
}

fn too_long(raw_len: usize) -> String {
    format!("zstd frame without a content size decodes to more than {raw_len} bytes")
}

/// What a zstd error `code` decoding into `raw_len` bytes is reported as.
fn zstd_error(code: usize, declared: Option<u64>, raw_len: usize) -> String {
    if declared.is_none() && is_dst_too_small(code) {
        return too_long(raw_len);
    }
    format!("zstd: {}", zstd::zstd_safe::get_error_name(code))
}

fn is_dst_too_small(code: usize) -> bool {
    use zstd::zstd_safe::zstd_sys::{ZSTD_ErrorCode, ZSTD_getErrorCode};
    // SAFETY: ZSTD_getErrorCode only inspects the number it is given.
    unsafe { ZSTD_getErrorCode(code) == ZSTD_ErrorCode::ZSTD_error_dstSize_tooSmall }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::blob::{build_header, TensorSpec};
    use crate::dtype::Dtype;
    use std::collections::BTreeMap;

    #[test]
    fn every_codec_round_trips() {
        let specs = vec![
            TensorSpec {
                name: "h".into(),
                dtype: Dtype::BF16,
                shape: vec![4, 8],
            },
            TensorSpec {
                name: "t".into(),
                dtype: Dtype::I64,
                shape: vec![4],
            },
        ];
        let header = build_header(&specs, &BTreeMap::new()).unwrap();
        let h: Vec<u8> = (0..64).map(|i| (i * 7 % 251) as u8).collect();
        let t: Vec<u8> = (0..32).map(|i| i as u8).collect();
        let raw: Vec<u8> = [&header[..], &h, &t].concat();
        for codec in Codec::ALL {
            let mut enc = Encoder::new(codec, 3).unwrap();
            let stored = enc
                .encode(&[&header, &h, &t], &[false, true, false])
                .unwrap();
            let decoded = decode(codec, &stored, raw.len() as u64).unwrap();
            assert_eq!(decoded.blob, raw, "{codec}");
            assert_eq!(decoded.header, blob::parse_header(&raw).unwrap(), "{codec}");
            assert!(decode(codec, &stored, raw.len() as u64 + 1).is_err());
        }
    }

    #[test]
    fn planes_split_in_chunks_round_trip() {
        // More elements than one plane chunk, and not a multiple of it; plus an odd-length
        // 1-byte tensor between two 2-byte ones.
        let n = 2 * PLANE_CHUNK_ELEMS as u64 + 12_345;
        let specs = vec![
            TensorSpec {
                name: "h".into(),
                dtype: Dtype::BF16,
                shape: vec![n],
            },
            TensorSpec {
                name: "b".into(),
                dtype: Dtype::U8,
                shape: vec![7],
            },
            TensorSpec {
                name: "f".into(),
                dtype: Dtype::F16,
                shape: vec![3],
            },
        ];
        let header = build_header(&specs, &BTreeMap::new()).unwrap();
        let h: Vec<u8> = (0..2 * n).map(|i| (i * 31 % 253) as u8).collect();
        let b = [9u8; 7];
        let f = [1u8, 2, 3, 4, 5, 6];
        let raw: Vec<u8> = [&header[..], &h, &b, &f].concat();
        for codec in Codec::ALL {
            let mut enc = Encoder::new(codec, 1).unwrap();
            for _ in 0..2 {
                // twice: the context is reused
                let stored = enc
                    .encode(&[&header, &h, &b, &f], &[false, true, false, true])
                    .unwrap();
                assert_eq!(
                    decode(codec, &stored, raw.len() as u64).unwrap().blob,
                    raw,
                    "{codec}"
                );
            }
        }
    }

    #[test]
    fn a_buffer_of_out_capacity_is_never_grown() {
        // Random bytes take zstd's payload near its bound; bf16 ones exp-huf's codes near their
        // longest. A recycled buffer must be filled where it is, never reallocated.
        let n = (1 << 20) + 3;
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let random: Vec<u8> = (0..2 * n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                (x >> 24) as u8
            })
            .collect();
        let zeros = vec![0u8; 2 * n];
        let specs = vec![TensorSpec {
            name: "h".into(),
            dtype: Dtype::BF16,
            shape: vec![n as u64],
        }];
        let header = build_header(&specs, &BTreeMap::new()).unwrap();
        for codec in Codec::ALL {
            let mut enc = Encoder::new(codec, 1).unwrap();
            let mut out = Vec::with_capacity(enc.out_capacity(header.len() + 2 * n));
            let (at, cap) = (out.as_ptr(), out.capacity());
            for data in [&random, &zeros, &random] {
                enc.encode_into(&[&header, data], &[false, true], &mut out)
                    .unwrap();
                assert_eq!((out.as_ptr(), out.capacity()), (at, cap), "{codec}");
                let raw = [&header[..], data].concat();
                assert_eq!(decode(codec, &out, raw.len() as u64).unwrap().blob, raw);
            }
        }
    }

    /// One zstd frame of `raw` without a content size, as streaming compressors write it.
    fn frame_without_size(raw: &[u8]) -> Vec<u8> {
        use zstd::zstd_safe::{CCtx, CParameter, InBuffer, OutBuffer};
        let mut c = CCtx::create();
        c.set_parameter(CParameter::ContentSizeFlag(false)).unwrap();
        let mut out = Vec::with_capacity(zstd::zstd_safe::compress_bound(raw.len()) + 64);
        let mut input = InBuffer::around(raw);
        {
            let mut output = OutBuffer::around(&mut out);
            c.compress_stream(&mut output, &mut input).unwrap();
            while c.end_stream(&mut output).unwrap() > 0 {}
        }
        assert!(matches!(
            zstd::zstd_safe::get_frame_content_size(&out),
            Ok(None)
        ));
        out
    }

    #[test]
    fn frames_without_a_content_size_decode_bounded_by_raw_len() {
        let specs = vec![TensorSpec {
            name: "h".into(),
            dtype: Dtype::BF16,
            shape: vec![40],
        }];
        let header = build_header(&specs, &BTreeMap::new()).unwrap();
        let h: Vec<u8> = (0..80u32).map(|i| (i * 13 % 7) as u8).collect();
        let raw: Vec<u8> = [&header[..], &h].concat();
        let stored = frame_without_size(&raw);
        let n = raw.len() as u64;
        assert_eq!(decode(Codec::Zstd, &stored, n).unwrap().blob, raw);
        let long = decode(Codec::Zstd, &stored, n - 1).unwrap_err();
        assert!(long.contains("decodes to more than"), "{long}");
        let short = decode(Codec::Zstd, &stored, n + 1).unwrap_err();
        assert!(short.contains("decoded"), "{short}");
        // bp16-zstd: the planes of the 2-byte tensor are joined after decoding.
        let mut planes = raw.clone();
        split_planes(&h, &mut planes[header.len()..]);
        let stored = frame_without_size(&planes);
        assert_eq!(decode(Codec::Bp16Zstd, &stored, n).unwrap().blob, raw);
        // Exactly one frame: not two, no bytes after it, not a cut one.
        let two = [&stored[..], &stored[..]].concat();
        assert!(decode(Codec::Bp16Zstd, &two, 2 * n)
            .unwrap_err()
            .contains("after the zstd frame"));
        assert!(decode(Codec::Bp16Zstd, &stored[..stored.len() - 1], n).is_err());
        assert!(decode(Codec::Zstd, b"not zstd", n)
            .unwrap_err()
            .contains("not a zstd frame"));
    }

    #[test]
    fn a_frame_header_libzstd_refuses_is_not_a_zstd_frame() {
        // The same frame as tests/test_py_format.py's: no content size, a window log of 41.
        let raw = vec![b'x'; 64];
        let mut stored = frame_without_size(&raw);
        assert_eq!(
            stored[4] & 0x20,
            0,
            "not single-segment: byte 5 is the window descriptor"
        );
        stored[5] = 31 << 3;
        let err = decode(Codec::Zstd, &stored, raw.len() as u64).unwrap_err();
        assert!(err.starts_with("zstd frame: "), "{err}");
    }

    #[test]
    fn levels() {
        assert!(check_level(3).is_ok());
        assert!(check_level(99).is_err());
    }
}
