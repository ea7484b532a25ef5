"""Exp-huf (codec 3 of docs/FORMAT.md) on the GPU (issues 21 and 32): encoded where the hidden
states are, the Rust encoder's bytes (``exphuf``; Triton kernels: ``exphuf_triton``), for
``compress_on="gpu"`` (``layertap.vllm.gpu_compress``); decoded on a trainer's GPU
(``exphuf_decode``, ``exphuf_columns``). ``benches/gpu/`` measures them (benches/RESULTS.md).
"""
