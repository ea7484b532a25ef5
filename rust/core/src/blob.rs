//! The safetensors blob a record decodes to: building its header from tensor descriptions (so
//! the writer can stream tensor bytes straight from the caller's buffers after it) and parsing
//! it back.
//!
//! Writers in this repository produce one canonical header, so that the Rust and the Python
//! writers make byte-identical records: compact JSON (no spaces), `__metadata__` first with its
//! entries sorted by name, then the tensors in the order given, packed in that order, the header
//! padded with spaces so that the data starts at a multiple of 8.

use crate::dtype::Dtype;
use crate::error::{Error, Result};
use std::borrow::Borrow;
use std::collections::BTreeMap;

/// Largest safetensors header a reader accepts (safetensors' own limit).
pub const MAX_HEADER_LEN: usize = 100_000_000;

/// Shape and dtype of one tensor of a record, without its bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorSpec {
    /// The tensor's name (`"hidden_states"`...).
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Dimensions, outermost first.
    pub shape: Vec<u64>,
}

impl TensorSpec {
    /// Number of bytes of the tensor's data. A shape is refused when its nonzero dimensions'
    /// product times the item size is 2^63 or more (docs/FORMAT.md, "Record payload"), empty
    /// tensors included: numpy and torch cannot make such a tensor, and the rule does not
    /// depend on the order of the dimensions.
    pub fn byte_len(&self) -> Result<u64> {
        let nonzero = self
            .shape
            .iter()
            .filter(|&&d| d != 0)
            .try_fold(self.dtype.size() as u64, |acc, &d| acc.checked_mul(d))
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| {
                Error::invalid(format!(
                    "tensor {:?}: shape {:?} is too large (2^63 bytes or more)",
                    self.name, self.shape
                ))
            })?;
        Ok(if self.shape.contains(&0) { 0 } else { nonzero })
    }
}

/// A tensor's place in a parsed blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Name, dtype and shape.
    pub spec: TensorSpec,
    /// Byte range of its data within the blob (absolute, header included).
    pub range: std::ops::Range<usize>,
}

/// The parsed header of a blob.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlobHeader {
    /// `__metadata__`, sorted by name.
    pub metadata: BTreeMap<String, String>,
    /// Tensors in the order of their data.
    pub tensors: Vec<TensorInfo>,
    /// Where tensor data starts (`8 + N`).
    pub data_start: usize,
}

/// Builds the header bytes (length prefix, JSON, padding) of a blob holding `tensors` in order,
/// with `metadata` as `__metadata__`. The blob is these bytes followed by each tensor's data.
///
/// The JSON is written directly (strings escaped by `serde_json`), not built as a
/// `serde_json::Value` first: a writer builds one header per record on its caller's thread, and
/// the tree of values cost it dozens of allocations per record.
pub fn build_header(
    tensors: &[TensorSpec],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    build_header_of(tensors, metadata)
}

/// [`build_header`] for specs held by reference (the writer's records own theirs).
pub(crate) fn build_header_of<S: Borrow<TensorSpec>>(
    tensors: &[S],
    metadata: &BTreeMap<String, String>,
) -> Result<Vec<u8>> {
    if tensors.is_empty() {
        return Err(Error::invalid("a record needs at least one tensor"));
    }
    let mut text = Vec::with_capacity(128 + 32 * metadata.len() + 96 * tensors.len());
    text.extend_from_slice(b"{\"__metadata__\":{");
    for (i, (k, v)) in metadata.iter().enumerate() {
        if i > 0 {
            text.push(b',');
        }
        json_str(&mut text, k);
        text.push(b':');
        json_str(&mut text, v);
    }
    text.push(b'}');
    let mut offset = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let t = t.borrow();
        if t.name.is_empty() || t.name == "__metadata__" {
            return Err(Error::invalid(format!(
                "tensor name {:?} is not allowed",
                t.name
            )));
        }
        if tensors[..i].iter().any(|o| o.borrow().name == t.name) {
            return Err(Error::invalid(format!(
                "tensor name {:?} is given twice",
                t.name
            )));
        }
        // Empty tensors (a zero-token record's `[0, layers, hidden]`) take no bytes.
        let len = t.byte_len()?;
        let end = offset + len;
        text.push(b',');
        json_str(&mut text, &t.name);
        text.extend_from_slice(b":{\"dtype\":");
        json_str(&mut text, t.dtype.name());
        text.extend_from_slice(b",\"shape\":[");
        for (j, d) in t.shape.iter().enumerate() {
            if j > 0 {
                text.push(b',');
            }
            write_u64(&mut text, *d);
        }
        text.extend_from_slice(b"],\"data_offsets\":[");
        write_u64(&mut text, offset);
        text.push(b',');
        write_u64(&mut text, end);
        text.extend_from_slice(b"]}");
        offset = end;
    }
    text.push(b'}');
    let padded = crate::format::align8(8 + text.len() as u64) as usize - 8;
    text.resize(padded, b' ');
    let mut out = Vec::with_capacity(8 + text.len());
    out.extend_from_slice(&(text.len() as u64).to_le_bytes());
    out.extend_from_slice(&text);
    Ok(out)
}

/// Appends `s` as a JSON string, escaped as `serde_json` escapes it.
fn json_str(out: &mut Vec<u8>, s: &str) {
    serde_json::to_writer(&mut *out, s).expect("writing to a Vec cannot fail");
}

fn write_u64(out: &mut Vec<u8>, n: u64) {
    use std::io::Write;
    write!(out, "{n}").expect("writing to a Vec cannot fail");
}

/// Parses and checks the header of a blob of `blob.len()` bytes: every tensor lies inside it,
/// tensors are packed without gaps or overlaps and end at the end of the blob.
/// `Err(reason)` says what is wrong.
pub fn parse_header(blob: &[u8]) -> std::result::Result<BlobHeader, String> {
    parse_header_of(blob, blob.len())
}

/// [`parse_header`] of a blob of `blob_len` bytes that begins with `blob` (which holds at least
/// the header), for decoders that know the header before the tensor data.
pub fn parse_header_of(blob: &[u8], blob_len: usize) -> std::result::Result<BlobHeader, String> {
    if blob.len() < 8 || blob_len < 8 {
        return Err("payload shorter than a safetensors header".into());
    }
    let n = u64::from_le_bytes(blob[..8].try_into().unwrap());
    if n > MAX_HEADER_LEN as u64 || 8 + n > blob.len().min(blob_len) as u64 {
        return Err(format!(
            "safetensors header length {n} does not fit the payload"
        ));
    }
    let data_start = 8 + n as usize;
    header_of_json(header_json(&blob[8..data_start])?, data_start, blob_len)
}

/// The JSON text of a safetensors header (the bytes after its length prefix) parsed, as the
/// object it must be. `Err(reason)` says what is wrong.
pub fn header_json(
    text: &[u8],
) -> std::result::Result<serde_json::Map<String, serde_json::Value>, String> {
    match crate::json_text::parse(text) {
        Ok(serde_json::Value::Object(json)) => Ok(json),
        Ok(_) => Err("safetensors header is not a JSON object".into()),
        Err(e) => Err(format!("safetensors header: {e}")),
    }
}

/// The rest of [`parse_header_of`], once the header's JSON (`json`, from [`header_json`]) is
/// parsed: its metadata and tensors checked for a blob of `blob_len` bytes whose data starts at
/// `data_start`.
pub fn header_of_json(
    json: serde_json::Map<String, serde_json::Value>,
    data_start: usize,
    blob_len: usize,
) -> std::result::Result<BlobHeader, String> {
    let mut metadata = BTreeMap::new();
    let mut tensors = Vec::new();
    for (name, v) in json {
        if name == "__metadata__" {
            let obj = v.as_object().ok_or("__metadata__ is not an object")?;
            for (k, v) in obj {
                let s = v
                    .as_str()
                    .ok_or_else(|| format!("__metadata__[{k:?}] is not a string"))?;
                metadata.insert(k.clone(), s.to_string());
            }
            continue;
        }
        let bad = |what: &str| format!("tensor {name:?}: {what}");
        let dtype = v
            .get("dtype")
            .and_then(|d| d.as_str())
            .ok_or_else(|| bad("no dtype"))?;
        let dtype = Dtype::from_name(dtype).map_err(|e| bad(&e.to_string()))?;
        let shape: Vec<u64> = v
            .get("shape")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
            .ok_or_else(|| bad("bad shape"))?;
        let offs: Vec<u64> = v
            .get("data_offsets")
            .and_then(|s| s.as_array())
            .and_then(|a| a.iter().map(|d| d.as_u64()).collect())
            .filter(|o: &Vec<u64>| o.len() == 2 && o[0] <= o[1])
            .ok_or_else(|| bad("bad data_offsets"))?;
        let spec = TensorSpec {
            name: name.clone(),
            dtype,
            shape,
        };
        if spec.byte_len().map_err(|e| e.to_string())? != offs[1] - offs[0] {
            return Err(bad("data length does not match dtype and shape"));
        }
        let range = (data_start as u64 + offs[0])..(data_start as u64 + offs[1]);
        if range.end > blob_len as u64 {
            return Err(bad("data lies outside the payload"));
        }
        tensors.push(TensorInfo {
            spec,
            range: range.start as usize..range.end as usize,
        });
    }
    // By (start, end): an empty tensor sits before a non-empty one starting at the same place.
    tensors.sort_by_key(|t| (t.range.start, t.range.end));
    let mut at = data_start;
    for t in &tensors {
        if t.range.start != at {
            return Err(format!(
                "tensor {:?} does not start where the previous one ends",
                t.spec.name
            ));
        }
        at = t.range.end;
    }
    if at != blob_len {
        return Err(format!("{} bytes after the last tensor", blob_len - at));
    }
    Ok(BlobHeader {
        metadata,
        tensors,
        data_start,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn specs() -> Vec<TensorSpec> {
        vec![
            TensorSpec {
                name: "hidden_states".into(),
                dtype: Dtype::BF16,
                shape: vec![3, 2, 4],
            },
            TensorSpec {
                name: "token_ids".into(),
                dtype: Dtype::I64,
                shape: vec![3],
            },
        ]
    }

    #[test]
    fn header_round_trip() {
        let meta = BTreeMap::from([("key".to_string(), "r1".to_string())]);
        let mut blob = build_header(&specs(), &meta).unwrap();
        assert_eq!(blob.len() % 8, 0);
        let start = blob.len();
        blob.resize(start + 48 + 24, 1);
        let h = parse_header(&blob).unwrap();
        assert_eq!(h.metadata, meta);
        assert_eq!(h.data_start, start);
        assert_eq!(h.tensors[0].range, start..start + 48);
        assert_eq!(h.tensors[1].spec, specs()[1]);
    }

    #[test]
    fn canonical_json() {
        let meta = BTreeMap::from([
            ("key".to_string(), "r1".to_string()),
            ("a".into(), "b".into()),
        ]);
        let h = build_header(&specs()[1..], &meta).unwrap();
        let text = std::str::from_utf8(&h[8..]).unwrap().trim_end();
        assert_eq!(
            text,
            r#"{"__metadata__":{"a":"b","key":"r1"},"token_ids":{"dtype":"I64","shape":[3],"data_offsets":[0,24]}}"#
        );
    }

    #[test]
    fn header_json_is_what_serde_json_makes() {
        // The JSON written directly equals serde_json's of the same tree, escapes included.
        let meta = BTreeMap::from([
            ("q\"uote".to_string(), "back\\slash\n\u{1}".to_string()),
            ("ünï".into(), "\u{1F600} tab\t".into()),
            ("key".into(), "</script>".into()),
        ]);
        let mut specs = specs();
        specs[0].name = "hidden \"states\"".into();
        let mut tree = serde_json::Map::new();
        tree.insert("__metadata__".into(), serde_json::to_value(&meta).unwrap());
        let mut offset = 0;
        for t in &specs {
            let end = offset + t.byte_len().unwrap();
            tree.insert(
                t.name.clone(),
                serde_json::json!({"dtype": t.dtype.name(), "shape": t.shape, "data_offsets": [offset, end]}),
            );
            offset = end;
        }
        let want = serde_json::to_vec(&serde_json::Value::Object(tree)).unwrap();
        let got = build_header(&specs, &meta).unwrap();
        assert_eq!(
            std::str::from_utf8(&got[8..])
                .unwrap()
                .trim_end()
                .as_bytes(),
            &want[..]
        );
    }

    #[test]
    fn rejects_bad_tensors() {
        let meta = BTreeMap::new();
        assert!(build_header(&[], &meta).is_err());
        let twice = vec![specs()[1].clone(), specs()[1].clone()];
        assert!(build_header(&twice, &meta)
            .unwrap_err()
            .to_string()
            .contains("twice"));
    }

    #[test]
    fn empty_tensors_take_no_bytes() {
        let meta = BTreeMap::new();
        let specs = vec![
            TensorSpec {
                name: "hidden_states".into(),
                dtype: Dtype::BF16,
                shape: vec![0, 2, 4],
            },
            TensorSpec {
                name: "token_ids".into(),
                dtype: Dtype::I64,
                shape: vec![0],
            },
        ];
        let blob = build_header(&specs, &meta).unwrap();
        let h = parse_header(&blob).unwrap();
        assert_eq!(h.tensors.len(), 2);
        assert!(h.tensors.iter().all(|t| t.range.is_empty()));
        assert_eq!(h.tensors[0].spec.shape, vec![0, 2, 4]);
    }

    #[test]
    fn parse_rejects_gaps_and_overruns() {
        let meta = BTreeMap::new();
        let mut blob = build_header(&specs()[1..], &meta).unwrap();
        blob.resize(blob.len() + 24, 0);
        assert!(parse_header(&blob[..blob.len() - 1]).is_err());
        let mut longer = blob.clone();
        longer.push(0);
        assert!(parse_header(&longer).is_err());
    }
}
