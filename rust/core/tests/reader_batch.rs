//! A batch's records read together (`reader::read_batch`, what `layertap.torch` reads batches
//! through): on every record of the shared vectors, from all the shards at once, on one thread
//! and on several, the placed tensor (zeros after it in a longer row) and the others hold the
//! bytes `ShardReader::read` gives, or the record is refused with its reason; and the stored
//! payloads copied out as the file holds them (`reader::read_stored_batch`, what the Dataset's
//! GPU decoding stages its batches through).

use layertap_core::format::crc32c;
use layertap_core::reader::{read_batch, read_stored_batch, BatchRead, ShardReader, StoredRead};
use layertap_core::Error;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

fn vectors() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/vectors");
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "lts"))
        .collect();
    out.sort();
    out
}

/// A reader of each shared vector that opens as a shard.
fn vector_readers() -> Vec<ShardReader> {
    vectors()
        .iter()
        .filter_map(|p| ShardReader::open(p).ok())
        .collect()
}

#[test]
fn a_batch_of_every_vector_reads_as_the_shard_reader_reads_each_record() {
    let readers = vector_readers();
    // Every record, with a row as long as its hidden_states (or 16 bytes, where it has none or
    // is corrupt: nothing is placed there).
    let mut wanted = Vec::new();
    for r in &readers {
        for i in 0..r.len() {
            let want = r.read(i, true);
            let len = want
                .as_ref()
                .ok()
                .and_then(|rec| {
                    rec.header
                        .tensors
                        .iter()
                        .find(|t| t.spec.name == "hidden_states")
                })
                .map_or(16, |t| t.range.len());
            wanted.push((r, i, want, len));
        }
    }
    for threads in [1, 3] {
        // Rows 8 bytes longer than the tensor on the second pass: zeros after it.
        let pad = if threads == 1 { 0 } else { 8 };
        let mut rows: Vec<Vec<u8>> = wanted.iter().map(|w| vec![0xEE; w.3 + pad]).collect();
        let mut batch: Vec<BatchRead<'_>> = wanted
            .iter()
            .zip(rows.iter_mut())
            .map(|((r, i, _, _), row)| BatchRead {
                reader: r,
                index: *i,
                dst: row,
                result: None,
            })
            .collect();
        read_batch(&mut batch, "hidden_states", true, threads);
        let (mut placed, mut corrupt) = (0, 0);
        for (b, (r, i, want, _)) in batch.iter().zip(&wanted) {
            let got = b.result.as_ref().expect("every result is set");
            match (want, got) {
                (Ok(rec), Ok(p)) => {
                    assert_eq!(p.header.metadata, rec.header.metadata);
                    for (k, t) in p.header.tensors.iter().enumerate() {
                        let whole = &rec.bytes.as_slice()[rec.header.tensors[k].range.clone()];
                        if p.placed == Some(k) {
                            let (data, zeros) = b.dst.split_at(whole.len());
                            assert_eq!(data, whole, "{:?} #{i}", r.path());
                            assert!(zeros.iter().all(|&z| z == 0) && zeros.len() == pad);
                            placed += 1;
                        } else {
                            assert_eq!(&p.rest[t.range.clone()], whole, "{:?} #{i}", r.path());
                        }
                    }
                }
                (
                    Err(Error::CorruptRecord { reason, .. }),
                    Err(Error::CorruptRecord { reason: r2, .. }),
                ) => {
                    assert_eq!(reason, r2);
                    corrupt += 1;
                }
                (w, g) => panic!("{:?} #{i}: {w:?} against {g:?}", r.path()),
            }
        }
        assert!(
            placed >= 20 && corrupt >= 1,
            "{placed} placed, {corrupt} corrupt"
        );
    }
}

#[test]
fn stored_payloads_of_every_vector_are_copied_as_the_file_holds_them() {
    let readers = vector_readers();
    // What the file holds at each record's payload, read apart from the reader's mapping.
    let mut wanted = Vec::new();
    for r in &readers {
        let file = std::fs::File::open(r.path()).unwrap();
        for (i, e) in r.entries().iter().enumerate() {
            let mut stored = vec![0u8; e.stored_len as usize];
            file.read_exact_at(&mut stored, e.payload_offset()).unwrap();
            let intact = crc32c(&stored) == e.payload_crc;
            wanted.push((r, i, stored, intact));
        }
    }
    for (threads, verify) in [(1, true), (3, true), (3, false)] {
        let mut out: Vec<Vec<u8>> = wanted.iter().map(|w| vec![0xEE; w.2.len()]).collect();
        let mut batch: Vec<StoredRead<'_>> = wanted
            .iter()
            .zip(out.iter_mut())
            .map(|((r, i, _, _), dst)| StoredRead {
                reader: r,
                index: *i,
                dst,
                result: None,
            })
            .collect();
        read_stored_batch(&mut batch, verify, threads);
        let (mut copied, mut mismatched) = (0, 0);
        for (b, (r, i, stored, intact)) in batch.iter().zip(&wanted) {
            assert_eq!(&b.dst[..], &stored[..], "{:?} #{i}", r.path());
            match b.result.as_ref().expect("every result is set") {
                Ok(()) => {
                    assert!(
                        *intact || !verify,
                        "{:?} #{i}: a bad checksum passed",
                        r.path()
                    );
                    copied += 1;
                }
                Err(Error::CorruptRecord { key, reason, .. }) => {
                    assert!(verify && !intact, "{:?} #{i}: {reason}", r.path());
                    assert!(reason.starts_with("payload checksum mismatch"), "{reason}");
                    assert_eq!(key.as_deref(), Some(r.entries()[*i].key.as_str()));
                    mismatched += 1;
                }
                Err(e) => panic!("{:?} #{i}: {e:?}", r.path()),
            }
        }
        assert!(copied >= 20, "{copied} copied");
        assert!(mismatched >= 1 || !verify, "no vector has a bad checksum");
    }
}

#[test]
fn a_stored_payload_needs_a_buffer_of_its_length() {
    let path = vectors()
        .into_iter()
        .find(|p| p.ends_with("bp16-zstd.lts"))
        .unwrap();
    let reader = ShardReader::open(&path).unwrap();
    let n = reader.entries()[0].stored_len as usize;
    for len in [n - 1, n + 1] {
        let mut dst = vec![0u8; len];
        match reader.read_stored(0, true, &mut dst) {
            Err(Error::InvalidInput(m)) => assert!(m.contains("stored_len"), "{m}"),
            other => panic!("a buffer of {len} for {n} bytes: {other:?}"),
        }
    }
}
