//! Any bytes as an `exp-huf` payload, with a raw length taken from the first 4 bytes: decoding
//! returns an error or exactly `raw_len` bytes, never panics. The same property runs on stable
//! as a proptest (`exphuf::tests::arbitrary_blocks_never_panic`, under `cargo test`).

#![no_main]

use layertap_core::codec::{decode, Codec};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() < 4 {
        return;
    }
    let raw_len = u32::from_le_bytes(data[..4].try_into().unwrap()) as u64 % (1 << 20);
    if let Ok(out) = decode(Codec::ExpHuf, &data[4..], raw_len) {
        assert_eq!(out.len() as u64, raw_len);
    }
});
