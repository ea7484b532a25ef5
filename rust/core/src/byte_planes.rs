//! The byte planes of codec `bp16-zstd` (docs/FORMAT.md, "Codecs"): 2-byte elements split into
//! a plane of their high bytes and a plane of their low bytes before zstd, and joined back after.
//! Every `bp16-zstd` record goes through here on both sides (the writer's split, the readers'
//! join), so both run 16 elements a step in SSE2 (part of x86_64) and in plain u64 arithmetic
//! elsewhere and for the last elements.

/// Splits 2-byte elements: all high bytes (odd positions), then all low bytes (even positions).
/// `src.len()` must be even; `dst` must have the same length.
pub fn split_planes(src: &[u8], dst: &mut [u8]) {
    debug_assert!(src.len().is_multiple_of(2) && dst.len() == src.len());
    let (high, low) = dst.split_at_mut(src.len() / 2);
    extract_plane(src, 1, high);
    extract_plane(src, 0, low);
}

/// Inverse of [`split_planes`].
pub fn join_planes(src: &[u8], dst: &mut [u8]) {
    debug_assert!(src.len().is_multiple_of(2) && dst.len() == src.len());
    let (high, low) = src.split_at(src.len() / 2);
    #[cfg(target_arch = "x86_64")]
    let done = join_sse2(high, low, dst);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    let (high, low, dst) = (&high[done..], &low[done..], &mut dst[2 * done..]);
    // Eight elements at a time, in plain u64 arithmetic (about four times the speed of a
    // byte loop, which the compiler does not vectorise well).
    let mut out = dst.chunks_exact_mut(16);
    let (mut hi8, mut lo8) = (high.chunks_exact(8), low.chunks_exact(8));
    for ((d, h), l) in (&mut out).zip(&mut hi8).zip(&mut lo8) {
        let h = u64::from_le_bytes(h.try_into().expect("8 bytes"));
        let l = u64::from_le_bytes(l.try_into().expect("8 bytes"));
        let first = spread(l & 0xFFFF_FFFF) | (spread(h & 0xFFFF_FFFF) << 8);
        let second = spread(l >> 32) | (spread(h >> 32) << 8);
        d[..8].copy_from_slice(&first.to_le_bytes());
        d[8..].copy_from_slice(&second.to_le_bytes());
    }
    let rest = out.into_remainder();
    for ((pair, &h), &l) in rest
        .chunks_exact_mut(2)
        .zip(hi8.remainder())
        .zip(lo8.remainder())
    {
        pair[0] = l;
        pair[1] = h;
    }
}

/// Writes byte `which` (0: low, 1: high) of every 2-byte element of `src` into `dst`.
pub(crate) fn extract_plane(src: &[u8], which: usize, dst: &mut [u8]) {
    debug_assert!(dst.len() == src.len() / 2);
    #[cfg(target_arch = "x86_64")]
    let done = extract_sse2(src, which, dst);
    #[cfg(not(target_arch = "x86_64"))]
    let done = 0;
    let (src, dst) = (&src[2 * done..], &mut dst[done..]);
    let shift = 8 * which as u32;
    let (mut src16, mut dst8) = (src.chunks_exact(16), dst.chunks_exact_mut(8));
    for (s, d) in (&mut src16).zip(&mut dst8) {
        let a = u64::from_le_bytes(s[..8].try_into().expect("8 bytes")) >> shift;
        let b = u64::from_le_bytes(s[8..].try_into().expect("8 bytes")) >> shift;
        d.copy_from_slice(&(pack(a) | (pack(b) << 32)).to_le_bytes());
    }
    for (d, pair) in dst8
        .into_remainder()
        .iter_mut()
        .zip(src16.remainder().chunks_exact(2))
    {
        *d = pair[which];
    }
}

/// The first whole 16s of elements of [`join_planes`]: each 16 high and 16 low bytes
/// interleaved by two byte unpacks. Returns how many elements it joined.
#[cfg(target_arch = "x86_64")]
fn join_sse2(high: &[u8], low: &[u8], dst: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let n = high.len().min(low.len()).min(dst.len() / 2) / 16 * 16;
    for i in (0..n).step_by(16) {
        let (h, l) = (&high[i..i + 16], &low[i..i + 16]);
        let d = &mut dst[2 * i..2 * i + 32];
        // SAFETY: SSE2 is part of x86_64; each load reads the 16 bytes of `h` or `l` and each
        // store writes 16 of the 32 bytes of `d`, slices whose lengths were checked when taken.
        unsafe {
            let h = _mm_loadu_si128(h.as_ptr().cast());
            let l = _mm_loadu_si128(l.as_ptr().cast());
            _mm_storeu_si128(d.as_mut_ptr().cast(), _mm_unpacklo_epi8(l, h));
            _mm_storeu_si128(d[16..].as_mut_ptr().cast(), _mm_unpackhi_epi8(l, h));
        }
    }
    n
}

/// The first whole 16s of elements of [`extract_plane`]: the wanted byte of each 16-bit lane
/// moved to its low byte (masked, or shifted down) and two vectors' lanes packed into bytes
/// (the values fit, so the pack's saturation never applies). Returns how many it wrote.
#[cfg(target_arch = "x86_64")]
fn extract_sse2(src: &[u8], which: usize, dst: &mut [u8]) -> usize {
    use std::arch::x86_64::*;
    let n = dst.len().min(src.len() / 2) / 16 * 16;
    for i in (0..n).step_by(16) {
        let s = &src[2 * i..2 * i + 32];
        let d = &mut dst[i..i + 16];
        // SAFETY: SSE2 is part of x86_64; the loads read the 32 bytes of `s` and the store
        // writes the 16 bytes of `d`, slices whose lengths were checked when taken.
        unsafe {
            let a = _mm_loadu_si128(s.as_ptr().cast());
            let b = _mm_loadu_si128(s[16..].as_ptr().cast());
            let (a, b) = if which == 0 {
                let low = _mm_set1_epi16(0x00FF);
                (_mm_and_si128(a, low), _mm_and_si128(b, low))
            } else {
                (_mm_srli_epi16::<8>(a), _mm_srli_epi16::<8>(b))
            };
            _mm_storeu_si128(d.as_mut_ptr().cast(), _mm_packus_epi16(a, b));
        }
    }
    n
}

/// The even bytes of `x` (bytes 0, 2, 4, 6), packed into its low 4 bytes.
#[inline(always)]
fn pack(x: u64) -> u64 {
    let x = x & 0x00FF_00FF_00FF_00FF;
    let x = (x | (x >> 8)) & 0x0000_FFFF_0000_FFFF;
    (x | (x >> 16)) & 0xFFFF_FFFF
}

/// The low 4 bytes of `x` spread to the even bytes (inverse of [`pack`]).
#[inline(always)]
fn spread(x: u64) -> u64 {
    let x = (x | (x << 16)) & 0x0000_FFFF_0000_FFFF;
    (x | (x << 8)) & 0x00FF_00FF_00FF_00FF
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every length from none to several SIMD steps and a remainder of each size: the planes
    /// hold the elements' high and low bytes, and join back to the elements.
    #[test]
    fn planes_round_trip_at_every_length() {
        for len in (0..300).step_by(2) {
            let src: Vec<u8> = (0..len)
                .map(|b| (b as u8).wrapping_mul(37) ^ (b >> 8) as u8)
                .collect();
            let mut split = vec![0; len];
            split_planes(&src, &mut split);
            let m = len / 2;
            for i in 0..m {
                assert_eq!(
                    (split[i], split[m + i]),
                    (src[2 * i + 1], src[2 * i]),
                    "len {len} element {i}"
                );
            }
            let mut back = vec![0; len];
            join_planes(&split, &mut back);
            assert_eq!(back, src, "len {len}");
        }
    }

    #[test]
    fn planes_round_trip() {
        let src: Vec<u8> = (0..64u8).collect();
        let mut split = vec![0; 64];
        split_planes(&src, &mut split);
        assert_eq!(split[0], 1); // high byte of element 0
        assert_eq!(split[32], 0); // low byte of element 0
        let mut back = vec![0; 64];
        join_planes(&split, &mut back);
        assert_eq!(back, src);
    }

    /// The SIMD steps alone against the u64 loop's bytes, from every offset of a buffer (so that
    /// loads and stores land at every alignment).
    #[test]
    fn simd_steps_equal_the_plain_loop() {
        let src: Vec<u8> = (0..700u32)
            .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
            .collect();
        for off in 0..32 {
            let s = &src[off..off + 640];
            for which in [0, 1] {
                let mut want = vec![0; 320];
                for (i, d) in want.iter_mut().enumerate() {
                    *d = s[2 * i + which];
                }
                let mut got = vec![0; 320];
                extract_plane(s, which, &mut got);
                assert_eq!(got, want, "offset {off}, byte {which}");
            }
            let mut joined = vec![0; 640];
            join_planes(s, &mut joined);
            for i in 0..320 {
                assert_eq!(
                    (joined[2 * i], joined[2 * i + 1]),
                    (s[320 + i], s[i]),
                    "offset {off}"
                );
            }
        }
    }
}
