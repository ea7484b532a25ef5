"""Work done on the GPU (issues 21 and 32): codec 3 of docs/FORMAT.md, exp-huf, encoded where the
hidden states are, byte for byte the Rust encoder's blocks coded by element (``exphuf``, its
device work in torch operations or in Triton kernels, ``exphuf_triton``), what the connector runs
with ``compress_on="gpu"`` (``layertap.vllm.gpu_compress``, docs/CONNECTOR.md); and decoded on a
trainer's GPU (``exphuf_decode``; ``exphuf_columns`` for blocks coded by column). The copies
between host and device that keep the host thread from spinning are ``device_copies``'.
``benches/gpu/`` measures them (benches/RESULTS.md has the numbers).
"""
