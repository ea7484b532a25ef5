//! The bytes of a record handed to a caller: its own private copy-on-write mapping of the file
//! (codec `none`, zero copy) or an owned buffer (decoded payloads, small records).

use crate::blob::{BlobHeader, TensorInfo};
use std::ptr::NonNull;

/// Records stored with codec `none` of at least this many bytes get their own private mapping of
/// the file instead of a copy. Below it a copy costs less than setting up and tearing down a
/// mapping, and keeps many small records from using up the process's mapping count.
pub const MAP_MIN_BYTES: u64 = 64 << 10;

/// The decoded bytes (a safetensors blob) of one record, which the caller may read and write.
///
/// Writing never reaches the file: mapped bytes come from a private copy-on-write mapping made
/// for this record alone, so each read of a record starts from the bytes in the file, whatever
/// was done to the buffers of an earlier read.
pub struct RecordBytes {
    ptr: NonNull<u8>,
    len: usize,
    owner: Owner,
}

enum Owner {
    /// A private (`MAP_PRIVATE`) mapping of the file; `ptr` points into it.
    Mapping(#[allow(dead_code)] memmap2::MmapMut),
    /// A heap buffer from `Box::into_raw`, freed in `drop`.
    Heap(NonNull<[u8]>),
}

// SAFETY: RecordBytes owns its memory exclusively (a mapping or a heap buffer no one else points
// to) and has no thread-affine state; sharing it only shares a pointer. Writing through that
// pointer while another thread reads is the writer's responsibility, as for any buffer handed out
// through the Python buffer or array interfaces.
unsafe impl Send for RecordBytes {}
// SAFETY: see `Send`; `&RecordBytes` only allows reading (`as_slice`) or taking the raw pointer.
unsafe impl Sync for RecordBytes {}

impl RecordBytes {
    /// Takes ownership of a decoded buffer.
    pub fn from_vec(v: Vec<u8>) -> RecordBytes {
        let len = v.len();
        let raw: *mut [u8] = Box::into_raw(v.into_boxed_slice());
        // SAFETY: Box::into_raw never returns null.
        let heap = unsafe { NonNull::new_unchecked(raw) };
        RecordBytes {
            ptr: heap.cast::<u8>(),
            len,
            owner: Owner::Heap(heap),
        }
    }

    /// Takes ownership of a private mapping holding exactly the record's bytes.
    pub(crate) fn from_mapping(mut map: memmap2::MmapMut) -> RecordBytes {
        let len = map.len();
        // The pointer is taken from `&mut` so that writes through it are allowed; the mapping
        // itself stays where the kernel put it when `map` moves into the struct.
        let ptr = NonNull::new(map.as_mut_ptr()).unwrap_or(NonNull::dangling());
        RecordBytes {
            ptr,
            len,
            owner: Owner::Mapping(map),
        }
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `ptr` points to `len` initialised bytes owned by `self.owner`, which lives as
        // long as `self`.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// A pointer to the bytes, valid for reads and writes of `len()` bytes for as long as this
    /// value lives. Whoever writes through it must make sure no slice from
    /// [`RecordBytes::as_slice`] is in use at the same time.
    pub fn as_mut_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Number of bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether there are no bytes.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Whether the bytes are a mapping of the file (zero copy) rather than a buffer.
    pub fn is_mapped(&self) -> bool {
        matches!(self.owner, Owner::Mapping(_))
    }
}

impl Drop for RecordBytes {
    fn drop(&mut self) {
        if let Owner::Heap(heap) = self.owner {
            // SAFETY: `heap` came from Box::into_raw in `from_vec` and is freed only here.
            drop(unsafe { Box::from_raw(heap.as_ptr()) });
        }
    }
}

impl std::fmt::Debug for RecordBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RecordBytes")
            .field("len", &self.len)
            .field("mapped", &self.is_mapped())
            .finish()
    }
}

/// A record read from a shard: its checked, decoded blob and parsed safetensors header.
#[derive(Debug)]
pub struct Record {
    /// The record key.
    pub key: String,
    /// Offset of the record's frame.
    pub offset: u64,
    /// `__metadata__` and the tensors, in the order of their data.
    pub header: BlobHeader,
    /// The blob.
    pub bytes: RecordBytes,
}

impl Record {
    /// The data of one of the record's tensors.
    pub fn tensor_data(&self, tensor: &TensorInfo) -> &[u8] {
        self.bytes
            .as_slice()
            .get(tensor.range.clone())
            .unwrap_or(&[])
    }
}
