//! The JSON texts of a shard: its metadata and each record's safetensors header
//! (docs/FORMAT.md, "Conventions"). RFC 8259 JSON within limits every reader shares, so that
//! this core and the pure-Python reader (`python/layertap/_spec/json_text.py`) accept exactly
//! the same texts. serde_json already refuses `NaN`, numbers beyond a double's range and
//! unpaired surrogate escapes; the nesting limit is ours (serde_json's own is 128).

/// Arrays and objects nest at most this deep (`[[1]]` is 2 deep).
pub const MAX_DEPTH: usize = 64;

/// The value of the JSON text `text`, or why it is refused.
pub fn parse(text: &[u8]) -> Result<serde_json::Value, String> {
    check_depth(text)?;
    serde_json::from_slice(text).map_err(|e| e.to_string())
}

/// Refuses a text whose brackets, outside strings, nest deeper than [`MAX_DEPTH`]. On a text
/// that is not JSON the count means nothing, but such a text is refused by the parser anyway.
fn check_depth(text: &[u8]) -> Result<(), String> {
    let (mut depth, mut deepest) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in text {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                deepest = deepest.max(depth);
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            _ => {}
        }
    }
    if deepest > MAX_DEPTH {
        return Err(format!(
            "arrays and objects nest {deepest} deep, more than {MAX_DEPTH}"
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn nested(depth: usize) -> String {
        "[".repeat(depth) + &"]".repeat(depth)
    }

    #[test]
    fn nesting_up_to_the_limit() {
        assert!(parse(nested(MAX_DEPTH).as_bytes()).is_ok());
        let err = parse(nested(MAX_DEPTH + 1).as_bytes()).unwrap_err();
        assert!(err.contains("nest 65 deep"), "{err}");
        // Brackets inside strings, escaped quotes included, do not count.
        let text = format!("[\"{}\\\"{}\"]", "[".repeat(100), "{".repeat(100));
        assert!(parse(text.as_bytes()).is_ok());
    }

    #[test]
    fn what_serde_json_refuses_is_refused() {
        for text in [
            "[NaN]",
            "[1e400]",
            "[-Infinity]",
            r#"["\ud800"]"#,
            r#"["\udc00x"]"#,
        ] {
            assert!(parse(text.as_bytes()).is_err(), "{text}");
        }
        // -0 is a float, as in Python's reader; a name given twice keeps its last value.
        assert_eq!(parse(b"[-0]").unwrap()[0].as_u64(), None);
        assert_eq!(parse(br#"{"a":1,"a":2}"#).unwrap()["a"], 2);
    }
}
