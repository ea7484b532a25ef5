//! `layertap._native`: Python bindings of `layertap-core`. Only conversions live here; the work
//! happens in the core, with the GIL released around all compression and I/O.

use pyo3::prelude::*;

mod buffers_in;
mod buffers_out;
mod codec;
mod errors;
mod options;
mod reader;
mod region;
mod writer;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("FORMAT_VERSION", layertap_core::format::VERSION)?;
    m.add(
        "MAX_THREADS",
        layertap_core::writer::WriterConfig::MAX_THREADS,
    )?;
    options::register(m)?;
    writer::register(m)?;
    reader::register(m)?;
    region::register(m)?;
    codec::register(m)?;
    Ok(())
}
