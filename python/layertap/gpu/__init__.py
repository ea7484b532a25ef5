"""Work done on the GPU before records reach the host writer (issue 21): encoders in torch
operations whose output is an existing codec of docs/FORMAT.md, byte for byte.

``exphuf``: codec 3, exp-huf, the Rust encoder's bytes coded by element (block mode 1; checked
on the CPU by the tests); one
tensor, a batch in one pass, or a batch's blocks back to back in one device buffer
(``encode_contiguous``, what the connector copies to the host). The connector runs it with
``compress_on="gpu"`` (``layertap.vllm.gpu_compress``, docs/CONNECTOR.md, "Compression on the
GPU"); the writer takes the blocks as encoded tensors and only checks their framing.

``exphuf_triton``: the same encoder's device work as Triton kernels (issue 32), chosen by
``impl="triton"`` (the default on CUDA where Triton imports), the code tables built on the host
or on the device (``tables``); the same bytes.

``exphuf_decode`` and ``exphuf_columns``: the decoder for trainers (issue 32, goal 3), exp-huf
payloads decoded on the device by Triton kernels, blocks coded by element (mode 1) and by
column (mode 2, the Rust writer's; ``exphuf_columns`` holds its kernels).

``benches/gpu/bench_gpu_exphuf.py`` measures the encoder on the H200 and
``benches/gpu/profile_exphuf.py`` says where its time goes; benches/RESULTS.md has the numbers.
"""
