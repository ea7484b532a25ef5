"""The host's share of the Triton exp-huf decoder (issue 33, goal 3): per batch, the CPU time
``layertap.gpu.exphuf_decode.decode_records`` spends before its kernels run, parsing the
records' safetensors headers and block heads and checking their code-length tables into the
arrays the kernels take. On an H100 this was ~33 ms a batch of 64 narrow records (MiniLM's 7 x
384 hidden, bf16, 256 tokens), what bounded records/s for such records.

It needs no GPU and no Triton interpreter: the kernels, and the torch operations that build the
decode tables on the device from the checked lengths, are replaced by stand-ins returning
zeros, so that what is timed is the host's parse and the numpy work around it (the same code
runs before and after the parse moved into the Rust core; ``_parsed_head``'s cache, where the
decoder has one, is emptied before each batch, as a trainer's next batch holds other keys).
The records are those the Rust writer writes (blocks coded by column, mode 2), with their
token ids; ``--by element`` codes them by element (mode 1, the GPU encoder's).

    PYTHONPATH=.venv/triton:python .venv/bin/python benches/gpu/host_parse_exphuf_decode.py --records 64
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from layertap import _native
from layertap._spec.blob import build_header
from layertap.gpu import exphuf_columns, exphuf_decode


def payloads(records: int, tokens: int, layers: int, hidden: int, by: str) -> list[bytes]:
    """``records`` exp-huf payloads of activations-like ``[tokens, layers, hidden]`` bf16 and
    their token ids, each with its own key (8 distinct tensors, repeated)."""
    out, sources = [], []
    for seed in range(min(records, 8)):
        g = torch.Generator().manual_seed(seed)
        scale = torch.logspace(-2, 1, hidden) * torch.linspace(0.5, 4, layers)[:, None]
        sources.append((torch.randn((tokens, layers, hidden), generator=g) * scale).to(torch.bfloat16))
    ids = torch.arange(tokens, dtype=torch.int64)
    for r in range(records):
        h = sources[r % len(sources)]
        meta = {"key": f"{r:06d}", "layer_ids": str(list(range(layers)))}
        header = build_header([("hidden_states", "BF16", tuple(h.shape)), ("token_ids", "I64", (tokens,))], meta)
        raw = header + h.reshape(-1).view(torch.uint8).numpy().tobytes() + ids.numpy().tobytes()
        out.append(_native.exphuf_encode(raw, by=by))
    return out


def stub_device_work() -> None:
    """The kernels and the device tables replaced by zeros of their shapes."""
    exphuf_decode.decode_tables = lambda lengths: torch.empty((lengths.shape[0], 2048), dtype=torch.int16)
    exphuf_decode._launch = lambda src, tables, top, out, desc, *a: torch.zeros((2, desc.shape[1]), dtype=torch.int32)
    exphuf_columns.chain_tables = lambda tables, ctx: torch.empty(tables.shape, dtype=torch.int32)
    exphuf_columns.launch_streams = lambda w, t, tops, desc, *a: torch.zeros((2, desc.shape[1]), dtype=torch.int32)
    exphuf_columns.launch_merge = lambda *a: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--records", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--shape", default="7x384", help="layers x hidden")
    ap.add_argument("--by", default="column", choices=["column", "element"])
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    layers, hidden = (int(x) for x in args.shape.split("x"))
    stored = payloads(args.records, args.tokens, layers, hidden, args.by)
    staging = exphuf_decode.Staging([len(p) for p in stored], "cpu")
    for view, p in zip(staging.views, stored):
        view[:] = p
    stub_device_work()
    torch.set_num_threads(1)  # process_time counts every thread's CPU
    cache = getattr(exphuf_decode, "_parsed_head", None)
    cpu, records_s, tables_s = [], [], []
    for _ in range(args.reps):
        if cache is not None:
            cache.cache_clear()
        timings: dict = {}
        t0 = time.process_time()
        exphuf_decode.decode_records(staging, "cpu", timings=timings)
        cpu.append(time.process_time() - t0)
        records_s.append(timings["records_s"])
        tables_s.append(timings.get("tables_s", 0.0))

    def ms(xs: list[float]) -> str:
        return f"{1e3 * statistics.median(xs):.2f}"

    print(
        f"{args.records} records [{args.tokens}, {layers}, {hidden}] by {args.by}: host CPU {ms(cpu)} ms a batch "
        f"(median of {args.reps}; min {1e3 * min(cpu):.2f}), records_s {ms(records_s)} ms, tables_s {ms(tables_s)} ms"
    )


if __name__ == "__main__":
    main()
