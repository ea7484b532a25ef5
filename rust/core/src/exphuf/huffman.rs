//! Canonical Huffman codes of at most [`MAX_CODE_LEN`] bits over the 512 symbols of codec
//! `exp-huf` (docs/FORMAT.md): code lengths from symbol counts, codes from lengths, and the
//! lookup tables the decoder indexes with the next [`MAX_CODE_LEN`] bits of a stream.
//!
//! Codes are canonical as in DEFLATE (RFC 1951, 3.2.2): shorter codes first, codes of one length
//! in symbol order. Streams are read least significant bit first, and a code's first bit is its
//! most significant, so the encoder writes each code bit-reversed.

/// Longest code, in bits. Decoders index their tables with this many bits.
pub const MAX_CODE_LEN: u32 = 11;

/// Symbols of the alphabet: the top 9 bits of an element.
pub const SYMBOLS: usize = 512;

/// Code lengths (0: symbol absent) for symbols with `counts`, none longer than [`MAX_CODE_LEN`].
///
/// A lone symbol gets a 1-bit code. Where the optimal code is too long, counts are halved
/// (staying above zero) until it fits: simple, and it costs well under 0.1% on activations.
pub fn code_lengths(counts: &[u32; SYMBOLS]) -> [u8; SYMBOLS] {
    let mut weights: Vec<(u64, u16)> = counts
        .iter()
        .enumerate()
        .filter(|(_, &c)| c > 0)
        .map(|(s, &c)| (c as u64, s as u16))
        .collect();
    let mut lengths = [0u8; SYMBOLS];
    match weights.len() {
        0 => return lengths,
        1 => {
            lengths[weights[0].1 as usize] = 1;
            return lengths;
        }
        _ => {}
    }
    loop {
        let got = optimal_lengths(&mut weights);
        if got.iter().all(|&(l, _)| l as u32 <= MAX_CODE_LEN) {
            for (l, s) in got {
                lengths[s as usize] = l;
            }
            return lengths;
        }
        for w in &mut weights {
            w.0 = w.0.div_ceil(2);
        }
    }
}

/// Huffman code lengths of `weights` (at least two), by the two-queue method over weights sorted
/// ascending: leaves in one queue, merged nodes (made in ascending order) in the other.
fn optimal_lengths(weights: &mut [(u64, u16)]) -> Vec<(u8, u16)> {
    weights.sort_unstable();
    let n = weights.len();
    // Nodes 0..n are leaves, n.. merged nodes; parent[i] is the node i was merged into.
    let mut weight: Vec<u64> = weights.iter().map(|w| w.0).collect();
    let mut parent = vec![0usize; 2 * n - 1];
    let (mut leaf, mut merged) = (0usize, n);
    let take = |weight: &Vec<u64>, leaf: &mut usize, merged: &mut usize| -> usize {
        let next_merged = if *merged < weight.len() {
            Some(weight[*merged])
        } else {
            None
        };
        if *leaf < n && next_merged.is_none_or(|m| weights[*leaf].0 <= m) {
            *leaf += 1;
            *leaf - 1
        } else {
            *merged += 1;
            *merged - 1
        }
    };
    for _ in 0..n - 1 {
        let a = take(&weight, &mut leaf, &mut merged);
        let b = take(&weight, &mut leaf, &mut merged);
        let node = weight.len();
        weight.push(weight[a] + weight[b]);
        parent[a] = node;
        parent[b] = node;
    }
    // Depths from the root (the last node) down: a parent always comes after its children.
    let root = 2 * n - 2;
    let mut depth = vec![0u8; 2 * n - 1];
    for i in (0..root).rev() {
        depth[i] = depth[parent[i]].saturating_add(1);
    }
    (0..n).map(|i| (depth[i], weights[i].1)).collect()
}

/// Why a set of code lengths is not a prefix code.
pub fn check_lengths(lengths: &[u8]) -> Result<(), String> {
    let mut kraft = 0u64;
    for &l in lengths {
        if l as u32 > MAX_CODE_LEN {
            return Err(format!("code length {l} is over {MAX_CODE_LEN}"));
        }
        if l > 0 {
            kraft += 1 << (MAX_CODE_LEN - l as u32);
        }
    }
    if kraft > 1 << MAX_CODE_LEN {
        return Err("code lengths are over-subscribed (not a prefix code)".into());
    }
    Ok(())
}

/// The canonical codes of `lengths` (checked with [`check_lengths`]), bit-reversed so that
/// writing them least significant bit first sends the code's first bit first; 0 for absent
/// symbols.
pub fn reversed_codes(lengths: &[u8; SYMBOLS]) -> [u16; SYMBOLS] {
    let mut codes = [0u16; SYMBOLS];
    let mut count = [0u32; MAX_CODE_LEN as usize + 1];
    for &l in lengths {
        count[l as usize] += 1;
    }
    count[0] = 0;
    let mut next = [0u32; MAX_CODE_LEN as usize + 2];
    let mut code = 0u32;
    for len in 1..=MAX_CODE_LEN as usize {
        code = (code + count[len - 1]) << 1;
        next[len] = code;
    }
    for (s, &l) in lengths.iter().enumerate() {
        if l > 0 {
            let c = next[l as usize];
            next[l as usize] += 1;
            codes[s] = reverse(c, l as u32) as u16;
        }
    }
    codes
}

/// The low `len` bits of `code` in reverse order.
fn reverse(code: u32, len: u32) -> u32 {
    code.reverse_bits() >> (32 - len)
}

/// Fills `table` (`1 << MAX_CODE_LEN` entries) so that entry `x` decodes the stream whose next
/// bits (least significant first) are `x`: `value(symbol) | code length`, or 0 where no code
/// starts with those bits. `lengths` must pass [`check_lengths`].
pub fn fill_decode_table<T: Copy + From<u8>>(
    lengths: &[u8; SYMBOLS],
    value: impl Fn(usize, u8) -> T,
    table: &mut [T],
) {
    debug_assert_eq!(table.len(), 1 << MAX_CODE_LEN);
    table.fill(T::from(0));
    let codes = reversed_codes(lengths);
    for (s, &l) in lengths.iter().enumerate() {
        if l == 0 {
            continue;
        }
        let entry = value(s, l);
        let step = 1usize << l;
        let mut x = codes[s] as usize;
        while x < table.len() {
            table[x] = entry;
            x += step;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(pairs: &[(usize, u32)]) -> [u32; SYMBOLS] {
        let mut c = [0; SYMBOLS];
        for &(s, n) in pairs {
            c[s] = n;
        }
        c
    }

    #[test]
    fn lengths_of_a_textbook_example() {
        // Weights 1, 1, 2, 4: lengths 3, 3, 2, 1.
        let l = code_lengths(&counts(&[(5, 1), (6, 1), (7, 2), (8, 4)]));
        assert_eq!((l[5], l[6], l[7], l[8]), (3, 3, 2, 1));
        assert!(check_lengths(&l).is_ok());
    }

    #[test]
    fn one_symbol_gets_one_bit_and_none_gets_nothing() {
        let l = code_lengths(&counts(&[(300, 9)]));
        assert_eq!(l[300], 1);
        assert_eq!(l.iter().map(|&x| x as u32).sum::<u32>(), 1);
        assert!(code_lengths(&[0; SYMBOLS]).iter().all(|&x| x == 0));
    }

    #[test]
    fn lengths_are_limited() {
        // Fibonacci weights make the deepest possible tree.
        let mut c = [0u32; SYMBOLS];
        let (mut a, mut b) = (1u32, 1u32);
        for s in c.iter_mut().take(30) {
            *s = a;
            (a, b) = (b, a.saturating_add(b));
        }
        let l = code_lengths(&c);
        assert!(l.iter().all(|&x| x as u32 <= MAX_CODE_LEN));
        assert!(l.iter().take(30).all(|&x| x > 0));
        assert!(check_lengths(&l).is_ok());
    }

    #[test]
    fn canonical_codes_decode_through_the_table() {
        let l = code_lengths(&counts(&[(1, 10), (2, 3), (3, 3), (4, 1), (500, 7)]));
        let codes = reversed_codes(&l);
        let mut table = vec![0u32; 1 << MAX_CODE_LEN];
        fill_decode_table(&l, |s, len| ((s as u32) << 8) | len as u32, &mut table);
        for s in [1usize, 2, 3, 4, 500] {
            let e = table[codes[s] as usize];
            assert_eq!((e >> 8, e & 0xFF), (s as u32, l[s] as u32));
        }
    }

    #[test]
    fn over_subscribed_lengths_are_refused() {
        let mut l = [0u8; SYMBOLS];
        l[..3].fill(1);
        assert!(check_lengths(&l).is_err());
        l[0] = 12;
        assert!(check_lengths(&l).is_err());
    }
}
