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
    /// A heap buffer from `Box::into_raw` (at least `len` bytes), kept for a later batch or
    /// record in `drop` (see [`RecordBytes::recycled`]).
    Recycled(NonNull<[u8]>),
}

/// Memory of batches and records that callers dropped, kept for the next ones (their pages stay
/// faulted in, so a batch or record decoded into them costs no page faults and no zeroing by
/// the kernel). A process forked while another thread held the lock finds it taken, and
/// allocates instead.
static IDLE: IdleMemory = IdleMemory::new(2);

/// Dropped memory kept for later callers: at most `keep` pieces, the largest ones. Two are
/// enough for a training loop, which holds one batch while the next is read, and for a loop
/// over records, which drops each before it reads the next.
struct IdleMemory {
    kept: parking_lot::Mutex<Vec<Box<[u8]>>>,
    keep: usize,
}

impl IdleMemory {
    const fn new(keep: usize) -> IdleMemory {
        IdleMemory {
            kept: parking_lot::Mutex::new(Vec::new()),
            keep,
        }
    }

    /// The smallest kept piece of at least `len` bytes, taken out.
    fn take(&self, len: usize) -> Option<Box<[u8]>> {
        let mut kept = self.kept.try_lock()?;
        let best = (0..kept.len())
            .filter(|&i| kept[i].len() >= len)
            .min_by_key(|&i| kept[i].len())?;
        Some(kept.swap_remove(best))
    }

    /// Keeps `memory`: while fewer than `keep` pieces are kept, else in place of the smallest
    /// one when it is larger (else it is freed).
    fn give(&self, memory: Box<[u8]>) {
        if let Some(mut kept) = self.kept.try_lock() {
            if kept.len() < self.keep {
                kept.push(memory);
            } else if let Some(smallest) = kept.iter_mut().min_by_key(|m| m.len()) {
                if smallest.len() < memory.len() {
                    *smallest = memory;
                }
            }
        }
    }
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

    /// `len` bytes for a caller to decode a batch or a record into, and to hand out as its
    /// memory: the smallest one a dropped batch or record left that is large enough (holding
    /// what that one held: the caller writes every byte it hands on), else new zeroed memory.
    /// When dropped, the memory is kept for a later one. `None` when the memory cannot be
    /// allocated.
    pub fn recycled(len: usize) -> Option<RecordBytes> {
        let memory = match IDLE.take(len) {
            Some(memory) => memory,
            None => zeroed(len)?,
        };
        // SAFETY: Box::into_raw never returns null.
        let heap = unsafe { NonNull::new_unchecked(Box::into_raw(memory)) };
        Some(RecordBytes {
            ptr: heap.cast::<u8>(),
            len,
            owner: Owner::Recycled(heap),
        })
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

    /// The bytes, to write into.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as for `as_slice`; `&mut self` makes this the only slice of them in use.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
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

/// `len` zeroed bytes, or `None` when they cannot be allocated (a batch's size comes from the
/// caller: a failure is an error to report, not an abort). Zeroed by the allocator, so that
/// pages the caller never writes are never faulted in.
fn zeroed(len: usize) -> Option<Box<[u8]>> {
    if len == 0 {
        return Some(Box::default());
    }
    let layout = std::alloc::Layout::array::<u8>(len).ok()?;
    // SAFETY: the layout's size is not zero (checked above).
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    let ptr = NonNull::new(ptr)?;
    // SAFETY: `ptr` is a live allocation of `len` initialised (zero) bytes made by the global
    // allocator with the layout of `[u8; len]`, which is what a `Box<[u8]>` of that length frees.
    Some(unsafe { Box::from_raw(std::ptr::slice_from_raw_parts_mut(ptr.as_ptr(), len)) })
}

impl Drop for RecordBytes {
    fn drop(&mut self) {
        match self.owner {
            Owner::Heap(heap) => {
                // SAFETY: `heap` came from Box::into_raw in `from_vec` and is freed only here.
                drop(unsafe { Box::from_raw(heap.as_ptr()) });
            }
            Owner::Recycled(heap) => {
                // SAFETY: `heap` came from Box::into_raw in `recycled` and is taken back only
                // here; no pointer into it is left (whoever held this value has dropped it).
                IDLE.give(unsafe { Box::from_raw(heap.as_ptr()) });
            }
            Owner::Mapping(_) => {}
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_memory_is_kept_for_the_next_caller_it_fits() {
        // A list of its own: the process-wide one is used by every read of the tests beside.
        let idle = IdleMemory::new(2);
        let a = zeroed(1 << 20).unwrap();
        assert!(a.iter().all(|&b| b == 0), "new memory is zeroed");
        let at = a.as_ptr();
        idle.give(a);
        assert!(idle.take(2 << 20).is_none(), "too small to be reused");
        let b = idle.take(1000).unwrap();
        assert_eq!(b.as_ptr(), at, "the dropped memory, whole");
        idle.give(b);
        idle.give(zeroed(2 << 20).unwrap());
        idle.give(zeroed(1000).unwrap()); // two kept already, both larger: freed
        let mut kept: Vec<usize> = idle.kept.lock().iter().map(|m| m.len()).collect();
        kept.sort_unstable();
        assert_eq!(
            kept,
            [1 << 20, 2 << 20],
            "the two largest kept, at their full size"
        );
        idle.give(zeroed(3 << 20).unwrap()); // in place of the smallest
        let mut kept: Vec<usize> = idle.kept.lock().iter().map(|m| m.len()).collect();
        kept.sort_unstable();
        assert_eq!(kept, [2 << 20, 3 << 20]);
    }

    #[test]
    fn recycled_memory_is_as_long_as_asked() {
        let a = RecordBytes::recycled(12345).unwrap();
        assert_eq!(a.len(), 12345);
        assert!(
            RecordBytes::recycled(isize::MAX as usize - 8).is_none(),
            "not allocated"
        );
        assert_eq!(RecordBytes::recycled(0).unwrap().len(), 0);
    }
}
