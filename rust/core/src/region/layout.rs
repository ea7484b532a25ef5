//! Where each token of a request lies in the hidden-states KV cache: from the scheduler's block
//! ids to the cache's rows. The Python reference is `layertap.vllm.gather.HiddenStatesCache`
//! (`write_indices`); `tests/vectors/layout.json` holds cases both must agree on.

use crate::error::{Error, Result};

/// How a token's place in the cache becomes indices.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Indices {
    /// One row number per layer: `tensor_block * per_block + offset * per_token + layer_row`.
    Rows {
        /// Rows per block of the cache tensor.
        per_block: i64,
        /// Rows per token.
        per_token: i64,
        /// The row of each saved layer (at least one).
        layer_rows: Vec<i64>,
    },
    /// `(tensor block, offset in it)` per token: the cache is not a table of rows (padded).
    BlockOffset,
}

/// The scheduler-block-to-cache-row layout of one engine's hidden-states cache.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layout {
    block_size: u64,
    tensor_block_size: u64,
    indices: Indices,
}

impl Layout {
    /// A layout of scheduler blocks of `block_size` tokens over cache blocks of
    /// `tensor_block_size` (a divisor: vLLM may split a scheduler block into kernel blocks).
    /// `row_steps = Some((rows per tensor block, rows per token))` with `layer_rows` gives row
    /// numbers; `None` gives `(block, offset)` pairs (and `layer_rows` is ignored).
    pub fn new(
        block_size: u64,
        tensor_block_size: u64,
        row_steps: Option<(i64, i64)>,
        layer_rows: Vec<i64>,
    ) -> Result<Layout> {
        if block_size == 0
            || tensor_block_size == 0
            || !block_size.is_multiple_of(tensor_block_size)
        {
            return Err(Error::invalid(format!(
                "block size {block_size} must be a positive multiple of the tensor block size {tensor_block_size}"
            )));
        }
        let indices = match row_steps {
            Some((per_block, per_token)) if !layer_rows.is_empty() => Indices::Rows {
                per_block,
                per_token,
                layer_rows,
            },
            Some(_) => return Err(Error::invalid("layer_rows must not be empty")),
            None => Indices::BlockOffset,
        };
        Ok(Layout {
            block_size,
            tensor_block_size,
            indices,
        })
    }

    /// Tokens per scheduler block.
    pub fn block_size(&self) -> u64 {
        self.block_size
    }

    /// int64 indices per token: the number of layers, or 2 (block, offset).
    pub fn width(&self) -> usize {
        match &self.indices {
            Indices::Rows { layer_rows, .. } => layer_rows.len(),
            Indices::BlockOffset => 2,
        }
    }

    /// Whether `blocks` hold `num_tokens` tokens.
    pub fn holds(&self, blocks: usize, num_tokens: usize) -> bool {
        (blocks as u64).saturating_mul(self.block_size) >= num_tokens as u64
    }

    /// Writes the indices of a request's first `out.len() / width()` tokens, which lie in the
    /// scheduler blocks `blocks` in order, into `out` (`width()` per token). The caller checked
    /// that the blocks hold that many tokens ([`Layout::holds`]); extra blocks are not read.
    pub fn write_request(&self, blocks: &[u64], out: &mut [i64]) {
        let width = self.width();
        let (bs, tbs) = (self.block_size, self.tensor_block_size);
        for (block, rows) in blocks.iter().zip(out.chunks_mut(width * bs as usize)) {
            for (off, row) in rows.chunks_exact_mut(width).enumerate() {
                let slot = block * bs + off as u64;
                let (blk, toff) = ((slot / tbs) as i64, (slot % tbs) as i64);
                match &self.indices {
                    Indices::Rows {
                        per_block,
                        per_token,
                        layer_rows,
                    } => {
                        let base = blk * per_block + toff * per_token;
                        for (r, layer) in row.iter_mut().zip(layer_rows) {
                            *r = base + layer;
                        }
                    }
                    Indices::BlockOffset => {
                        row[0] = blk;
                        row[1] = toff;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn indices(layout: &Layout, blocks: &[u64], n: usize) -> Vec<i64> {
        let mut out = vec![-1; n * layout.width()];
        layout.write_request(blocks, &mut out);
        out
    }

    #[test]
    fn rows_of_a_token_major_cache() {
        // [blocks, 4 tokens, 2 layers, hidden]: 8 rows per block, 2 per token, layers 0 and 1.
        let layout = Layout::new(4, 4, Some((8, 2)), vec![0, 1]).unwrap();
        assert_eq!(
            indices(&layout, &[3, 1], 6),
            [24, 25, 26, 27, 28, 29, 30, 31, 8, 9, 10, 11]
        );
    }

    #[test]
    fn kernel_blocks_split_a_scheduler_block() {
        // Scheduler blocks of 4 tokens over cache blocks of 2: block 1 is cache blocks 2 and 3.
        let layout = Layout::new(4, 2, None, vec![]).unwrap();
        assert_eq!(indices(&layout, &[1], 3), [2, 0, 2, 1, 3, 0]);
    }

    #[test]
    fn bad_layouts_are_refused() {
        for (bs, tbs) in [(0, 1), (4, 0), (6, 4)] {
            let err = Layout::new(bs, tbs, None, vec![]).unwrap_err().to_string();
            assert!(err.contains("positive multiple"), "{err}");
        }
        let err = Layout::new(4, 4, Some((1, 1)), vec![]).unwrap_err();
        assert!(err.to_string().contains("layer_rows must not be empty"));
    }

    proptest! {
        /// Every token's indices are its slot's, computed one token at a time.
        #[test]
        fn matches_the_slot_formula(
            tbs in 1u64..5, per_tbs in 1u64..4, layers in 1usize..4,
            blocks in proptest::collection::vec(0u64..50, 0..6), cut in 0usize..16,
            by_rows: bool,
        ) {
            let bs = tbs * per_tbs;
            let n = (blocks.len() * bs as usize).saturating_sub(cut);
            let layer_rows: Vec<i64> = (0..layers as i64).map(|l| l * 7).collect();
            let steps = by_rows.then_some((1000, 10));
            let layout = Layout::new(bs, tbs, steps, layer_rows.clone()).unwrap();
            prop_assert!(layout.holds(blocks.len(), n));
            let got = indices(&layout, &blocks, n);
            for t in 0..n {
                let slot = blocks[t / bs as usize] * bs + (t as u64 % bs);
                let (blk, off) = ((slot / tbs) as i64, (slot % tbs) as i64);
                let want: Vec<i64> = if by_rows {
                    layer_rows.iter().map(|l| blk * 1000 + off * 10 + l).collect()
                } else {
                    vec![blk, off]
                };
                let w = layout.width();
                prop_assert_eq!(&got[t * w..(t + 1) * w], &want[..]);
            }
        }
    }
}
