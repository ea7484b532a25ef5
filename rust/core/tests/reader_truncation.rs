//! A shard cut at any offset (a writer killed at any moment) opens, and yields exactly the
//! records whose frames are wholly present.

mod reader_common;

use layertap_core::codec::Codec;
use layertap_core::format::FILE_HEADER_FIXED_LEN;
use layertap_core::reader::{Problem, ShardReader};
use layertap_core::Error;
use reader_common::*;

#[test]
fn truncation_at_every_offset() {
    let dir = tempfile::tempdir().unwrap();
    let shard = build_shard(
        &[
            RecordSpec::sample("t-0", Codec::Bp16Zstd, 2, 0),
            RecordSpec::sample("t-1", Codec::None, 1, 1),
            RecordSpec::sample("t-2", Codec::Zstd, 3, 2),
        ],
        true,
    );
    let full = shard.bytes.len() as u64;
    let header_end = (FILE_HEADER_FIXED_LEN + shard.meta_json.len() + 4) as u64;
    let index_end = full - 32;
    assert!(
        header_end < shard.header_len,
        "the test needs a file header with padding"
    );
    for cut in 0..=full {
        let path = write_file(dir.path(), "s.lts", &shard.bytes[..cut as usize]);
        let ctx = format!("cut at {cut}");
        let r = match ShardReader::open(&path) {
            Err(Error::NotAShard { .. }) if cut < header_end => continue,
            Ok(_) if cut < header_end => panic!("{ctx}: opened a cut header"),
            res => res.unwrap_or_else(|e| panic!("{ctx}: {e}")),
        };
        let present = (0..shard.entries.len())
            .filter(|&i| shard.frame_end(i) <= cut)
            .count();
        assert_eq!(r.entries(), &shard.entries[..present], "{ctx}");
        let data_end = if present == 0 {
            r.header_len()
        } else {
            shard.frame_end(present - 1)
        };
        assert_eq!(r.data_end(), data_end.min(cut).max(r.header_len()), "{ctx}");
        assert_eq!(r.is_complete(), cut == full, "{ctx}");
        // A cut inside the header's padding leaves no torn tail (and data_end past the cut).
        let torn = if cut == full || (index_end..full).contains(&cut) {
            0
        } else {
            cut.saturating_sub(data_end)
        };
        assert_eq!(r.torn_tail_bytes(), torn, "{ctx}");
        let want_problems: Vec<Problem> = if torn > 0 {
            vec![Problem::TornTail {
                offset: data_end,
                len: torn,
            }]
        } else if (index_end..full).contains(&cut) {
            // The index frame is whole but its trailer is not.
            assert!(r.index_unusable(), "{ctx}");
            assert!(
                matches!(r.problems(), [Problem::BadIndex { offset: Some(o), .. }] if *o == shard.data_end),
                "{ctx}: {:?}",
                r.problems()
            );
            r.problems().to_vec()
        } else {
            vec![]
        };
        assert_eq!(r.problems(), &want_problems[..], "{ctx}");
        for i in 0..present {
            assert_eq!(
                r.read(i, true).unwrap().bytes.as_slice(),
                &shard.raws[i][..],
                "{ctx}: record {i}"
            );
            r.check(i).unwrap();
        }
    }
}
