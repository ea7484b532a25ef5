//! Recovery (to be written).
