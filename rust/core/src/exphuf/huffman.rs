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
/// A lone symbol gets a 1-bit code. Where the optimal code is too long, the counts are divided
/// by the fewest powers of two `2^h` (rounding up, so none becomes 0) that make it fit: simple,
/// and it costs well under 0.1% on activations. `h` is found by bisection between 0 and the `h`
/// at which every count is 1 (a balanced code of at most 9 bits, so the result always fits):
/// a few Huffman builds a table instead of one per halving, which the GPU encoder's thousand
/// tables a batch felt (14 us a table on the H200's host). Dividing more flattens the counts,
/// so the `h` found is the fewest that fit, or one near it where flattening is not monotone.
pub fn code_lengths(counts: &[u32; SYMBOLS]) -> [u8; SYMBOLS] {
    let mut sorted = [(0u64, 0u16); SYMBOLS];
    let mut n = 0;
    for (s, &c) in counts.iter().enumerate() {
        if c > 0 {
            sorted[n] = (c as u64, s as u16);
            n += 1;
        }
    }
    let sorted = &mut sorted[..n];
    let mut lengths = [0u8; SYMBOLS];
    match n {
        0 => return lengths,
        1 => {
            lengths[sorted[0].1 as usize] = 1;
            return lengths;
        }
        _ => {}
    }
    // By count, then symbol. Dividing every count by 2^h, rounding up, keeps this order, so the
    // leaves of every build below are sorted by weight without sorting again.
    sorted.sort_unstable();
    let mut tree = Tree::new();
    let fits = |h: u32, tree: &mut Tree| {
        tree.build(sorted.iter().map(|&(c, _)| (c + (1 << h) - 1) >> h), n);
        tree.depth[..n].iter().all(|&d| d as u32 <= MAX_CODE_LEN)
    };
    if !fits(0, &mut tree) {
        let (mut lo, mut hi) = (0, u64::BITS - sorted[n - 1].0.leading_zeros());
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if fits(mid, &mut tree) {
                hi = mid;
            } else {
                lo = mid;
            }
        }
        fits(hi, &mut tree);
    }
    for (&(_, s), &d) in sorted.iter().zip(&tree.depth[..n]) {
        lengths[s as usize] = d;
    }
    lengths
}

/// A Huffman tree of at most [`SYMBOLS`] leaves, kept between builds (no allocation).
struct Tree {
    weight: [u64; 2 * SYMBOLS - 1],
    parent: [u16; 2 * SYMBOLS - 1],
    /// Depth of each node; leaves `0..n` first, in the order their weights were given.
    depth: [u8; 2 * SYMBOLS - 1],
}

impl Tree {
    fn new() -> Self {
        Tree {
            weight: [0; 2 * SYMBOLS - 1],
            parent: [0; 2 * SYMBOLS - 1],
            depth: [0; 2 * SYMBOLS - 1],
        }
    }

    /// Builds the tree of `n` (at least two) leaves of `weights`, given in ascending order, by
    /// the two-queue method: leaves in one queue, merged nodes (made in ascending order) in the
    /// other; on equal weights the leaf goes first.
    fn build(&mut self, weights: impl Iterator<Item = u64>, n: usize) {
        for (w, given) in self.weight.iter_mut().zip(weights) {
            *w = given;
        }
        let (mut leaf, mut merged) = (0, n);
        for next in n..2 * n - 1 {
            let mut take = || {
                if leaf < n && (merged >= next || self.weight[leaf] <= self.weight[merged]) {
                    leaf += 1;
                    leaf - 1
                } else {
                    merged += 1;
                    merged - 1
                }
            };
            let (a, b) = (take(), take());
            self.weight[next] = self.weight[a] + self.weight[b];
            self.parent[a] = next as u16;
            self.parent[b] = next as u16;
        }
        // Depths from the root (the last node) down: a parent always comes after its children.
        let root = 2 * n - 2;
        self.depth[root] = 0;
        for i in (0..root).rev() {
            self.depth[i] = self.depth[self.parent[i] as usize].saturating_add(1);
        }
    }
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

    /// Sequential halving, one build each (what `code_lengths` did before its bisection).
    fn halving_reference(counts: &[u32; SYMBOLS]) -> [u8; SYMBOLS] {
        let mut c = *counts;
        loop {
            let mut sorted: Vec<(u64, u16)> = (0..SYMBOLS)
                .filter(|&s| c[s] > 0)
                .map(|s| (c[s] as u64, s as u16))
                .collect();
            sorted.sort_unstable();
            let mut tree = Tree::new();
            tree.build(sorted.iter().map(|w| w.0), sorted.len());
            if tree.depth[..sorted.len()]
                .iter()
                .all(|&d| d as u32 <= MAX_CODE_LEN)
            {
                let mut l = [0u8; SYMBOLS];
                for (&(_, s), &d) in sorted.iter().zip(&tree.depth) {
                    l[s as usize] = d;
                }
                return l;
            }
            c = c.map(|x| x.div_ceil(2));
        }
    }

    #[test]
    fn bisected_divisions_code_as_tightly_as_halving_one_at_a_time() {
        let mut x = 7u64;
        let mut rnd = move || {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            x >> 33
        };
        let bits = |l: &[u8; SYMBOLS], c: &[u32; SYMBOLS]| -> u64 {
            l.iter().zip(c).map(|(&l, &c)| l as u64 * c as u64).sum()
        };
        let (mut got, mut want) = (0, 0);
        for t in 0..300 {
            // Exponent-like (a peak with geometric tails), near-uniform, and sparse wide counts.
            let centre = 64 + rnd() as usize % 384;
            let c: [u32; SYMBOLS] = std::array::from_fn(|s| match t % 3 {
                0 => (1u32 << 20) >> centre.abs_diff(s).min(31) | (rnd() % 16 == 0) as u32,
                1 => (rnd() % 5 * (rnd() % 1000)) as u32,
                _ => (rnd() % 4 == 0) as u32 * (rnd() % (1 << (rnd() % 30))) as u32,
            });
            let l = code_lengths(&c);
            assert!(check_lengths(&l).is_ok(), "table {t}");
            assert!((0..SYMBOLS).all(|s| (l[s] > 0) == (c[s] > 0)), "table {t}");
            got += bits(&l, &c);
            want += bits(&halving_reference(&c), &c);
        }
        assert!(
            got as f64 <= want as f64 * 1.0001,
            "{got} bits against {want}"
        );
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
