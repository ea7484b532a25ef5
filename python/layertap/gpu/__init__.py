"""Work done on the GPU before records reach the host writer (issue 21): encoders in torch
operations whose output is an existing codec of docs/FORMAT.md, byte for byte.

Built: ``exphuf`` (codec 3, exp-huf: the Rust encoder's bytes, checked on the CPU; one tensor or
a batch in one pass). Not built yet, the plan for the connector (``compress_on="gpu"``):

1. the engine thread gathers a step's finished rows into a device staging buffer (a pool
   allocated at start-up, like the pinned host pool) instead of the pinned pool, on the copy
   stream, and records an event; it does not wait;
2. a thread of the connector's own waits for the event, runs ``encode_blocks`` over the step's
   records on a stream of its own (its two small copies to the host synchronise that stream
   only), copies the encoded bytes, not the raw ones, into the pinned pool, and hands each
   record's payload (blob header + blocks) to the writer as already encoded;
3. the writer (a submission of encoded payloads, still to add to the core) checksums, frames
   and writes it like any record.

Where it cannot run (no CUDA, torch too old), the connector falls back to host compression with
one log line saying why. The speed to beat, and what the H200 measured of the alternatives:
benches/RESULTS.md (2026-12-02, "nvCOMP on real activations"); ``benches/gpu/bench_gpu_exphuf.py``
measures this encoder there.
"""
