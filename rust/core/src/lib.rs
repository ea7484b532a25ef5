//! # layertap-core
//!
//! The shard format, codecs, writer and reader of layertap, with no Python in them. The Python
//! bindings (`rust/python`) are a thin layer over this crate.
//!
//! - [`format`](mod@format): byte layout of shards (file header, frames, index, trailer) and codec ids.
//! - [`blob`]: the safetensors blob a record decodes to.
//! - [`codec`]: what the codecs `none`, `zstd`, `bp16-zstd`, `exp-huf` do to a payload.
//! - [`exphuf`]: codec `exp-huf`, Huffman-coded exponents of floating tensors.
//! - [`fp8`]: the writer's lossy stage, float8 e4m3 with a scale per token.
//!
//! Modules depend downwards only: [`error`] < [`format`](mod@format) < [`blob`] < [`codec`] < [`reader`],
//! [`writer`] < [`region`].
//! - [`names`]: keys, writer ids, shard file names.
//! - [`record`]: the hidden-states record's tensor and metadata names (docs/RECORD.md).
//! - [`reader`]: memory-mapped shard reader, scanning of open shards, verification.
//! - [`recover`]: making a shard whose writer died complete again.
//! - [`writer`]: the threaded, batching shard writer with io_uring and pwrite backends.
//! - [`region`]: the vLLM connector's path into the writer: a host pool's regions as records.
//!
//! The format itself is specified in `docs/FORMAT.md`, included below as the [`spec`] module.

#![warn(missing_docs)]
// A library reports through its return values, never on the process's stdout or stderr (its
// tests may print).
#![cfg_attr(not(test), warn(clippy::print_stdout, clippy::print_stderr))]

pub mod blob;
pub mod byte_planes;
pub mod codec;
pub mod dtype;
pub mod error;
pub mod exphuf;
pub mod format;
pub mod fp8;
pub mod json_text;
pub mod names;
pub mod options;
mod parallel;
pub mod reader;
pub mod record;
pub mod recover;
pub mod region;
pub mod writer;

#[doc = include_str!("../../../docs/FORMAT.md")]
pub mod spec {}

pub use codec::Codec;
pub use dtype::Dtype;
pub use error::{Error, Result};
