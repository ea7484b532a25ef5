//! Bindings of the core reader (being written).

use pyo3::prelude::*;

/// Adds this module's classes and functions to `layertap._native`.
pub fn register(_m: &Bound<'_, PyModule>) -> PyResult<()> {
    Ok(())
}
