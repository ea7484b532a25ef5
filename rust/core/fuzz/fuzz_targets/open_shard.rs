//! Any bytes, written to a file and opened as a shard: opening, reading and checking every record
//! and recovering must return errors, never panic, and a record that reads must be well formed.

#![no_main]

use layertap_core::reader::ShardReader;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let dir = tempfile_dir();
    let path = dir.join("fuzz.lts");
    std::fs::write(&path, data).unwrap();
    if let Ok(r) = ShardReader::open(&path) {
        for i in 0..r.len() {
            if let Ok(rec) = r.read(i, true) {
                // A record that reads has its key and tensors inside its bytes.
                assert_eq!(rec.header.metadata.get("key"), Some(&r.entries()[i].key));
                for t in &rec.header.tensors {
                    assert!(t.range.end <= rec.bytes.len());
                }
            }
            let _ = r.read(i, false);
            let _ = r.raw(i, true);
            let _ = r.check(i);
        }
        let _ = r.problems().iter().map(|p| p.to_string()).count();
    }
    let _ = layertap_core::recover::recover(&path);
    let _ = ShardReader::open(&path).map(|r| (0..r.len()).map(|i| r.check(i).is_ok()).count());
});

/// A directory of this process's own under the system temporary directory.
fn tempfile_dir() -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("layertap-fuzz-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
