//! Writer (to be written).
