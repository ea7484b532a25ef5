"""Checks of the Triton decoder of exp-huf (layertap.gpu.exphuf_decode) in Triton's interpreter,
on the CPU: records the Rust encoder wrote by element (``_native.exphuf_encode(raw, by="element")``,
block mode 1, what the GPU encoder writes) and by column (``_native.exphuf_encode(raw)``, mode 2,
what the Rust writer writes; the ``cols-`` cases, and ``cols-...-streams-S`` ones whose blocks the
reference encoder cut into S streams) decode to tensors bit for bit equal to the originals and to
the core's decode, in one batch of both modes, and damaged payloads raise CorruptRecordError
(which the Rust decoder also refuses) rather than crash or read outside the buffer. Not collected by pytest:
vLLM's CPU build must never see triton, so tests/test_triton_exphuf_decoder.py runs this script
in a subprocess with ``PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1``.

    PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1 python tests/triton_kernels/check_exphuf_decoder.py CASE...
    PYTHONPATH=python python3 tests/triton_kernels/check_exphuf_decoder.py --device cuda   # on a GPU

With no CASE it lists the cases (on CUDA it runs them all, with the encoder's full sizes and, where
.devbundle/acts is, real activations). The records of the decoding cases named go to the decoder in
one batch, as a trainer's would (the interpreter's time is the longest segment's elements, a few
milliseconds each, not the batch's size); each damaged payload goes alone. Prints ``ok CASE``
per case that passes, ``FAIL CASE: why`` per one that does not, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from test_gpu_exphuf import activations_like  # noqa: E402

from layertap import _native  # noqa: E402
from layertap._py import exphuf as py_exphuf  # noqa: E402
from layertap._spec import exphuf as spec  # noqa: E402
from layertap._spec.blob import build_header, parse_header  # noqa: E402
from layertap.errors import CorruptRecordError, InvalidInputError  # noqa: E402
from layertap.gpu import exphuf_columns, exphuf_decode  # noqa: E402
from layertap.gpu.exphuf_decode import decode_records  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # its frontend cheaper a step, same results: faster_interpreter.py
    import faster_interpreter

    faster_interpreter.install()

ACTIVATIONS = TESTS.parent / ".devbundle" / "acts" / "activations-2k.safetensors"
NAMES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}


def payload(tensors: dict[str, torch.Tensor], by: str = "element", streams: int | None = None) -> tuple[bytes, bytes]:
    """A record holding ``tensors`` (the blob, and its exp-huf payload by the Rust encoder, coded
    ``by`` element, mode 1, or column, mode 2; or, with ``streams``, by the reference encoder,
    its blocks coded by column in that many streams)."""
    header = build_header([(n, NAMES[t.dtype], tuple(t.shape)) for n, t in tensors.items()], {"key": "k"})
    raw = header + b"".join(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() for t in tensors.values())
    if streams is not None:
        return raw, py_exphuf.encode(raw, streams=streams)
    return raw, _native.exphuf_encode(raw, by=by)


def case_payload(name: str, tensors: dict[str, torch.Tensor]) -> tuple[bytes, bytes]:
    """The payload of case ``name``: ``cols-`` cases coded by column (``-streams-S``: S streams)."""
    name = base_case(name)
    if not name.startswith("cols-"):
        return payload(tensors)
    streams = int(name.rsplit("-", 1)[1]) if "-streams-" in name else None
    return payload(tensors, by="column", streams=streams)


def core_tensors(raw: bytes, stored: bytes) -> dict[str, bytes]:
    """The tensors' bytes as the Rust core decodes ``stored``."""
    _, tensors = _native.decode_record(stored, key="k", codec=3, raw_len=len(raw), payload_crc=None, path="x", offset=0)
    return {name: np.asarray(buf).tobytes() for name, _, _, buf in tensors}


def special_values(dtype) -> torch.Tensor:
    values = [float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40, -1e-39, 3.0, -2.5e-3]
    return torch.tensor(values * 150, dtype=torch.float32).to(dtype).reshape(-1, len(values))


def _f16(shape) -> torch.Tensor:
    """float16 of four exponents, mantissas in [1, 1.125]: few symbols, so that a block of 1,536
    elements is coded (f16 activations need about 6,000)."""
    g = torch.Generator().manual_seed(3)
    sign = torch.randint(0, 2, shape, generator=g) * 2 - 1
    exponent = torch.randint(-2, 2, shape, generator=g)
    return (sign * 2.0**exponent * (1 + torch.rand(shape, generator=g) / 8)).to(torch.float16)


def _incompressible() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randint(-(2**15), 2**15, (4096,), dtype=torch.int16, generator=g).view(torch.bfloat16)


#: Decoding cases: name -> the record's tensors. The shapes are the encoder's cases cut to fewer
#: tokens: the interpreter takes a few milliseconds a step, and a kernel's steps are its longest
#: stream's elements (a quarter of a mode-1 block, a stream's columns of a mode-2 one), so each
#: case is as small as what it is for allows (a segment longer than the stride where a context
#: is meant, shorter where not; streams of several columns; a block still coded). The full
#: sizes run on a GPU (``ON_GPU``).
RECORDS = {
    "BF16-2x3x256": lambda: {"h": activations_like((2, 3, 256), torch.bfloat16)},  # contexts a layer back
    "BF16-7x2x100": lambda: {"h": activations_like((7, 2, 100), torch.bfloat16, seed=1)},  # segments cut rows
    "BF16-1000": lambda: {"h": activations_like((1000,), torch.bfloat16, seed=2)},  # no context
    "F16-6x4x64": lambda: {"h": _f16((6, 4, 64))},  # exponents in a narrow range: coded
    "F32-20x50": lambda: {"h": activations_like((20, 50), torch.float32, seed=4)},
    "BF16-2x800": lambda: {"h": activations_like((2, 800), torch.bfloat16, seed=5)},  # stride > segment
    # strides 1, 2 and 3: the kernel takes the next element's context from the element it just
    # decoded, the one before, or memory
    "BF16-1200x1": lambda: {"h": activations_like((1200, 1), torch.bfloat16, seed=11)},
    "BF16-400x2": lambda: {"h": activations_like((400, 2), torch.bfloat16, seed=12)},
    "F32-400x3": lambda: {"h": activations_like((400, 3), torch.float32, seed=13)},
    "one-symbol": lambda: {"h": torch.full((1000,), 1.5, dtype=torch.bfloat16)},
    "special-values": lambda: {
        "b": special_values(torch.bfloat16),
        "f": special_values(torch.float32),
        "h": special_values(torch.float16),
    },
    "incompressible": lambda: {"h": _incompressible()},  # a raw block (mode 0)
    "short": lambda: {"h": activations_like((7, 9), torch.bfloat16, seed=6)},  # under 64 elements: raw
    "ids-only": lambda: {"token_ids": torch.arange(7, 30, dtype=torch.int64)},  # no block at all
    "multi-tensor": lambda: {
        "hidden_states": activations_like((12, 2, 48), torch.bfloat16, seed=8),
        "token_ids": torch.arange(1000, 1012, dtype=torch.int64),
        "scores": activations_like((12, 5), torch.float32, seed=9),
        "empty": torch.zeros((0, 4), dtype=torch.bfloat16),
    },
    # Coded by column (mode 2): the Rust writer's blocks (4 streams below 65,536 elements), and the
    # reference encoder's with other stream counts. A lane decodes a stream, 6 x 256 / 4 codes for
    # the first case.
    "cols-BF16-2x3x256": lambda: {"h": activations_like((2, 3, 256), torch.bfloat16)},
    "cols-BF16-70x13": lambda: {"h": activations_like((70, 13), torch.bfloat16, seed=21)},  # 3, 3, 3, 4 columns
    "cols-BF16-1000": lambda: {"h": activations_like((1000,), torch.bfloat16, seed=2)},  # 1-D: one row
    "cols-F16-6x4x64": lambda: {"h": _f16((6, 4, 64))},
    "cols-F32-20x50": lambda: {"h": activations_like((20, 50), torch.float32, seed=4)},
    "cols-F32-400x3": lambda: {"h": activations_like((400, 3), torch.float32, seed=22)},  # a column a stream
    "cols-special-values": lambda: {
        "b": special_values(torch.bfloat16),
        "f": special_values(torch.float32),
        "h": special_values(torch.float16),
    },
    "cols-multi-tensor": lambda: {
        "hidden_states": activations_like((12, 2, 48), torch.bfloat16, seed=8),
        "token_ids": torch.arange(1000, 1012, dtype=torch.int64),
        "scores": activations_like((12, 5), torch.float32, seed=9),
        "empty": torch.zeros((0, 4), dtype=torch.bfloat16),
    },
    "cols-BF16-60x20-streams-7": lambda: {"h": activations_like((60, 20), torch.bfloat16, seed=23)},  # 2-3 columns
    "cols-F32-300x9-streams-9": lambda: {"h": activations_like((300, 9), torch.float32, seed=24)},
    "cols-BF16-16x3x64-streams-16": lambda: {"h": activations_like((16, 3, 64), torch.bfloat16, seed=25)},
    "cols-BF16-800-streams-1": lambda: {"h": activations_like((800,), torch.bfloat16, seed=26)},
}


#: On a GPU only: the encoder's full sizes.
ON_GPU = {
    "BF16-64x3x256": lambda: {"h": activations_like((64, 3, 256), torch.bfloat16)},
    "F16-100x4x64": lambda: {"h": activations_like((100, 4, 64), torch.float16, seed=3)},
    "cols-BF16-64x3x256": lambda: {"h": activations_like((64, 3, 256), torch.bfloat16)},
    "cols-F32-64x3x256": lambda: {"h": activations_like((64, 3, 256), torch.float32, seed=3)},
    # the writer's 8 and 24 streams (4 a 32,768 elements)
    "cols-BF16-2x32768": lambda: {"h": activations_like((2, 32768), torch.bfloat16, seed=27)},
    "cols-BF16-256x3x256": lambda: {"h": activations_like((256, 3, 256), torch.bfloat16, seed=28)},
}

#: Cases with no coded block (raw blocks, mode 0, or other dtypes); every other case has one.
RAW_ONLY = {"incompressible", "short", "ids-only"}


def block_modes(raw: bytes, stored: bytes) -> list[str]:
    """Each tensor's block kind in ``stored``, walked with the Python reference decoder."""
    _, tensors, data_start = parse_header(raw)
    at, modes = data_start, []
    for t in tensors:
        if t.dtype in spec.CODED:
            modes.append({spec.MODE_CODED: "coded", spec.MODE_COLUMNS: "columns"}.get(stored[at], "raw"))
            if stored[at] == spec.MODE_COLUMNS:  # its streams
                modes[-1] += f"/{int.from_bytes(stored[at + 9 : at + 13], 'little')}"
            width = spec.CODED[t.dtype][0]
            _, at = spec.decode_block(stored, at, (t.end - t.begin) // width, width)
        else:
            modes.append("bytes")
            at += t.end - t.begin
    return modes


def _streams(stored: bytes, header_len: int) -> tuple[int, list[int]]:
    """Where the stream lengths of a payload's first (coded) block are, and the lengths."""
    at = header_len + 1 + 8 + 256
    contexts, streams = stored[header_len + 1], stored[header_len + 2]
    for _ in range(contexts):
        count = int.from_bytes(stored[at + 2 : at + 4], "little")
        at += 4 + (count + 1) // 2
    return at, [int.from_bytes(stored[at + 8 * k : at + 8 * k + 8], "little") for k in range(streams)]


def _damaged() -> dict:
    """Damaged payloads: name -> (payload, a word the error must hold)."""
    _, stored = payload({"h": activations_like((768,), torch.bfloat16, seed=10)})  # 4 streams of 192
    head_len = 8 + int.from_bytes(stored[:8], "little")
    at, sizes = _streams(stored, head_len)
    first = at + 8 * len(sizes)
    out = {}
    moved = bytearray(stored)  # stream 0 one byte longer, stream 1 one shorter
    moved[at : at + 16] = (sizes[0] + 1).to_bytes(8, "little") + (sizes[1] - 1).to_bytes(8, "little")
    out["stream-lengths"] = (bytes(moved), "stream 0 holds more bytes")
    ones = bytearray(stored)  # stream 1 all ones: garbage codes, then a wrong length
    ones[first + sizes[0] : first + sizes[0] + sizes[1]] = b"\xff" * sizes[1]
    out["stream-garbage"] = (bytes(ones), "stream 1")
    end0 = first + sizes[0] - 1
    if stored[end0] < 0x80:  # stream 0's padding: its last byte's top bit
        padded = bytearray(stored)
        padded[end0] |= 0x80
        out["stream-padding"] = (bytes(padded), "padding")
    lengths = bytearray(stored)  # context 0's code lengths all 1: not a prefix code
    table0 = head_len + 1 + 8 + 256
    count = int.from_bytes(stored[table0 + 2 : table0 + 4], "little")
    lengths[table0 + 4 : table0 + 4 + count // 2] = b"\x11" * (count // 2)
    out["code-lengths"] = (bytes(lengths), "context 0: code lengths are over-subscribed")
    out["trailing-byte"] = (stored + b"\0", "after the last tensor")
    out["cut-off"] = (stored[:-40], "runs past the payload")
    return out


def _column_streams(stored: bytes, head_len: int) -> tuple[int, int, list[int]]:
    """Where the stream lengths of a payload's first block (coded by column) are, where its
    streams start, and the lengths."""
    assert stored[head_len] == spec.MODE_COLUMNS, "the first block is not coded by column"
    n_streams = int.from_bytes(stored[head_len + 9 : head_len + 13], "little")
    at = head_len + 1 + 12 + 256
    for _ in range(stored[head_len + 1]):
        count = int.from_bytes(stored[at + 2 : at + 4], "little")
        at += 4 + (count + 1) // 2
    return at, n_streams, [int.from_bytes(stored[at + 8 * k : at + 8 * k + 8], "little") for k in range(n_streams)]


def _damaged_columns() -> dict:
    """Damaged payloads coded by column (the Rust writer's): name -> (payload, a word the error
    must hold). The tensor's 914 elements leave 2 padding bits in the raw plane, and its 457
    columns make 4 streams of 114 or 115 columns (2 rows: 230 codes at most a stream)."""
    raw, stored = payload({"h": activations_like((2, 457), torch.bfloat16, seed=10)}, by="column")
    head_len = 8 + int.from_bytes(stored[:8], "little")
    at, n_streams, sizes = _column_streams(stored, head_len)
    assert n_streams == 4, n_streams
    plane_end = at + 8 * n_streams + (914 * 7 + 7) // 8
    first = plane_end  # stream 0's first byte
    out = {}
    moved = bytearray(stored)  # stream 0 one byte longer, stream 1 one shorter
    moved[at : at + 16] = (sizes[0] + 1).to_bytes(8, "little") + (sizes[1] - 1).to_bytes(8, "little")
    out["stream-lengths"] = (bytes(moved), "stream 0 holds more bytes")
    ones = bytearray(stored)  # stream 1 all ones: garbage codes, then a wrong length
    ones[first + sizes[0] : first + sizes[0] + sizes[1]] = b"\xff" * sizes[1]
    out["stream-garbage"] = (bytes(ones), "stream 1")
    # A byte of stream 2 flipped: the first one (from its middle on) the Rust decoder refuses.
    for b in range(first + sizes[0] + sizes[1] + sizes[2] // 2, first + sum(sizes[:3])):
        flipped = bytearray(stored)
        flipped[b] ^= 0xFF
        if not _core_accepts(raw, bytes(flipped)):
            out["flipped-byte"] = (bytes(flipped), "stream 2")
            break
    end0 = first + sizes[0] - 1
    if stored[end0] < 0x80:  # stream 0's padding: its last byte's top bit
        padded = bytearray(stored)
        padded[end0] |= 0x80
        out["stream-padding"] = (bytes(padded), "stream 0 has padding bits that are not zero")
    plane = bytearray(stored)  # the raw plane's last byte's top bit: padding (914 * 7 % 8 = 6)
    plane[plane_end - 1] |= 0x80
    out["plane-padding"] = (bytes(plane), "the raw plane's padding bits are not zero")
    columns = bytearray(stored)  # 64 columns do not divide 914 elements
    columns[head_len + 5 : head_len + 9] = (64).to_bytes(4, "little")
    out["columns"] = (bytes(columns), "block of 914 elements in rows of 64 columns")
    streams = bytearray(stored)  # more streams than columns
    streams[head_len + 9 : head_len + 13] = (458).to_bytes(4, "little")
    out["streams"] = (bytes(streams), "block has 458 streams for 457 columns")
    out["trailing-byte"] = (stored + b"\0", "after the last tensor")
    out["cut-stream"] = (stored[:-3], "a stream runs past the payload")
    out["cut-plane"] = (stored[: plane_end - 1], "the raw plane runs past the payload")
    return out


def _core_accepts(raw: bytes, stored: bytes) -> bool:
    try:
        _native.decode_record(stored, key="k", codec=3, raw_len=len(raw), payload_crc=None, path="x", offset=0)
    except CorruptRecordError:
        return False
    return True


def check_decoding(names: list[str], known: dict, device: torch.device, **variant) -> list[str]:
    records = {n: known[base_case(n)]() for n in names}
    blobs = {n: case_payload(n, ts) for n, ts in records.items()}
    if device.type == "cuda" and variant.get("column_lanes", 32) % 32:
        return check_refused(names, [stored for _, stored in blobs.values()], device, variant)
    t0 = time.perf_counter()
    limit = exphuf_decode._POS32_LIMIT
    exphuf_decode._POS32_LIMIT = variant.pop("pos32_limit", limit)
    try:
        decoded = decode_records([stored for _, stored in blobs.values()], device=device, **variant)
    except Exception:
        for name in names:
            print(f"FAIL {name}: the batch raised", flush=True)
        traceback.print_exc(file=sys.stdout)
        return names
    finally:
        exphuf_decode._POS32_LIMIT = limit
    print(f"decoded {len(names)} records in one batch in {time.perf_counter() - t0:.1f} s {variant}", flush=True)
    failed = []
    for name, tensors, got in zip(names, records.values(), decoded):
        got = {k: v.cpu() for k, v in got.items()}
        why = None
        modes = block_modes(*blobs[name])
        columns = any(m.startswith("columns") for m in modes)
        if ("coded" in modes or columns) == (base_case(name) in RAW_ONLY):
            why = f"blocks {modes}: the case does not test what it is for"
        if why is None and columns != base_case(name).startswith("cols-"):
            why = f"blocks {modes}: the case does not test the mode it is for"
        core = core_tensors(*blobs[name])
        if why is None and sorted(got) != sorted(tensors):
            why = f"tensors {sorted(got)} instead of {sorted(tensors)}"
        for t_name, want in tensors.items():
            t = got.get(t_name)
            if why is None and (t.dtype != want.dtype or t.shape != want.shape):
                why = f"{t_name}: {t.dtype} {tuple(t.shape)} instead of {want.dtype} {tuple(want.shape)}"
            if why is None and not torch.equal(t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
                diff = (t.reshape(-1).view(torch.uint8) != want.reshape(-1).view(torch.uint8)).nonzero()[0].item()
                why = f"{t_name}: bytes differ first at byte {diff}"
            if why is None and t.reshape(-1).view(torch.uint8).numpy().tobytes() != core[t_name]:
                why = f"{t_name}: differs from the core's decode"
        print(f"ok {name}: blocks {' '.join(modes)}" if why is None else f"FAIL {name}: {why}", flush=True)
        if why is not None:
            failed.append(name)
    return failed


def check_refused(names: list[str], stored: list[bytes], device: torch.device, variant: dict) -> list[str]:
    """A variant CUDA does not take (lanes of a program that are not whole warps): the batch is
    refused with the decoder's one-line error naming the setting, before anything is launched."""
    try:
        decode_records(stored, device=device, **variant)
    except InvalidInputError as e:
        named = all(f"{k} " in str(e) for k in variant)
        for name in names:
            print(f"ok {name}: refused on {device.type}: {e}" if named else f"FAIL {name}: {e}", flush=True)
        return [] if named else names
    except Exception:
        for name in names:
            print(f"FAIL {name}: raised another error than InvalidInputError", flush=True)
        traceback.print_exc(file=sys.stdout)
        return names
    for name in names:
        print(f"FAIL {name}: decoded with {variant} on {device.type}, which refuses it", flush=True)
    return names


def check_tensor_payloads(name: str, device: torch.device) -> bool:
    """Payloads already on the device (uint8 tensors) beside ones in host memory, in one batch,
    coded by element and by column."""
    tensors = RECORDS["multi-tensor"]()
    _, stored = payload(tensors)
    _, by_column = payload(tensors, by="column")  # mode 2: its stream lengths and plane read back too
    on_device = torch.frombuffer(bytearray(stored), dtype=torch.uint8).to(device)
    columns_on_device = torch.frombuffer(bytearray(by_column), dtype=torch.uint8).to(device)
    try:
        got = decode_records([on_device, stored, on_device[:], columns_on_device, by_column], device=device)
    except Exception:
        print(f"FAIL {name}: raised", flush=True)
        traceback.print_exc(file=sys.stdout)
        return False
    for rec in got:
        for t_name, want in tensors.items():
            t = rec[t_name].cpu()
            if t.shape != want.shape or not torch.equal(
                t.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)
            ):
                print(f"FAIL {name}: {t_name} differs", flush=True)
                return False
    print(f"ok {name}: 5 records, 2 coded by column", flush=True)
    return True


def check_damaged(name: str, stored: bytes, word: str, device: torch.device) -> bool:
    # The raw length the header gives (a wrong one alone would make the core refuse any payload).
    head_len = 8 + int.from_bytes(stored[:8], "little")
    tensors = json.loads(stored[8:head_len])
    raw_len = head_len + max(v["data_offsets"][1] for k, v in tensors.items() if k != "__metadata__")
    if _core_accepts(b"\0" * raw_len, stored):
        print(f"FAIL {name}: the Rust decoder accepts it: not a damaged payload", flush=True)
        return False
    try:
        decode_records([stored], device=device)
    except CorruptRecordError as e:
        if word not in str(e):
            print(f"FAIL {name}: {word!r} not in the error: {e}", flush=True)
            return False
        print(f"ok {name}: {e}", flush=True)
        return True
    except Exception:
        print(f"FAIL {name}: raised another error", flush=True)
        traceback.print_exc(file=sys.stdout)
        return False
    print(f"FAIL {name}: decoded without an error", flush=True)
    return False


#: Other settings of the kernel, each on a few cases (a case named with the suffix): the
#: plainest variant (each element's context and stream words loaded in its own step, 64 lanes a
#: program), which the benchmark compares; programs of 32 lanes with 4 of them decoding (a
#: block's streams; what a small batch takes on a GPU; the interpreter runs programs one after
#: another, so the cases are small); and bit positions in int64.
VARIANTS = {
    "-plain-kernel": (
        ["BF16-1000", "BF16-400x2", "F32-400x3", "multi-tensor"],
        {"ahead": False, "buffered": False, "lanes_per_program": 64},
    ),
    "-live-4": (["BF16-1000", "F32-20x50", "multi-tensor"], {"lanes_per_program": 32, "live_lanes": 4}),
    # bit positions in int64, which streams of 2^31 bits or more take
    "-pos64": (["BF16-400x2", "F32-20x50", "cols-BF16-70x13", "cols-F32-20x50"], {"pos32_limit": 0}),
    # the mode-2 streams kernel's lanes over several programs (4 a program); CUDA takes whole
    # warps only, so there the check is that the decoder refuses the setting (check_refused)
    "-column-lanes-4": (["cols-BF16-60x20-streams-7", "cols-multi-tensor"], {"column_lanes": 4}),
}


def base_case(name: str) -> str:
    for suffix in VARIANTS:
        name = name.removesuffix(suffix)
    return name


def start_compiling():
    """The kernel compiled to an H200's code (sm_90, with the ptxas triton ships) in every variant
    the benchmark runs and for both element widths: no GPU needed, so that a GPU call cannot fail
    on it. In a child process without the interpreter (which takes triton.language over), started
    first so that it runs beside the decoding cases."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen(
        [sys.executable, __file__, "--compile"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def check_compiles(name: str, child) -> bool:
    out, _ = child.communicate()
    print(f"ok {name}: {out.strip()}" if child.returncode == 0 else f"FAIL {name}:\n{out}", flush=True)
    return child.returncode == 0


def compile_for_sm90() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    kernel = exphuf_decode._decode_kernel
    kernel = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)  # the interpreter's
    pointers = {"words_ptr": "*i64", "tables_ptr": "*i16", "table_of_top_ptr": "*i32", "desc_ptr": "*i64", "status_ptr": "*i32"}  # fmt: skip
    done = 0
    try:
        for lanes, ahead, buffered in [(32, True, True), (64, True, True), (128, True, True), (32, True, False), (32, False, False), (128, False, False)]:  # fmt: skip
            for width in (2, 4):
                words = "*i32" if width == 2 else "*i64"
                signature = {**pointers, "words_ptr": words, "out_ptr": "*i16" if width == 2 else "*i32", "lanes": "i32"}  # fmt: skip
                constants = {"RAW_BITS": 8 * width - 9, "LANES": lanes, "AHEAD": ahead, "BUFFERED": buffered, "POS64": lanes == 64}  # fmt: skip
                signature |= dict.fromkeys(constants, "constexpr")
                source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
                options = {"num_warps": max(1, lanes // 32), "num_stages": 1}
                compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
                assert compiled.asm["cubin"], "no cubin"
                done += 1
    except Exception:
        print(f"after {done} variants:", flush=True)
        traceback.print_exc(file=sys.stdout)
        return 1
    # The mode-2 kernels (exphuf_columns): the streams kernel in the lanes the decoder and the
    # benchmark use, with 32- and 64-bit positions; the merge kernel for both widths.
    streams = exphuf_columns._streams_kernel
    streams = streams if isinstance(streams, JITFunction) else JITFunction(streams.fn)
    merge = exphuf_columns._merge_kernel
    merge = merge if isinstance(merge, JITFunction) else JITFunction(merge.fn)
    try:
        for lanes in (32, 64, 128, 256):
            for pos64 in (False, True):
                signature = {"words_ptr": "*i32", "tables_ptr": "*i32", "tops_ptr": "*i16", "desc_ptr": "*i64", "status_ptr": "*i32", "lanes": "i32", "LANES": "constexpr", "POS64": "constexpr"}  # fmt: skip
                source = ASTSource(fn=streams, signature=signature, constexprs={"LANES": lanes, "POS64": pos64})
                options = {"num_warps": max(1, lanes // 32), "num_stages": 1}
                assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"]
                done += 1
        for width in (2, 4):
            signature = {"words_ptr": "*i32", "tops_ptr": "*i16", "out_ptr": "*i16" if width == 2 else "*i32", "job_ptr": "*i64", "programs": "i32", "RAW_BITS": "constexpr", "BLOCK": "constexpr"}  # fmt: skip
            constants = {"RAW_BITS": 8 * width - 9, "BLOCK": exphuf_columns.MERGE_BLOCK}
            source = ASTSource(fn=merge, signature=signature, constexprs=constants)
            assert triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}).asm["cubin"]
            done += 1
    except Exception:
        print(f"after {done} variants:", flush=True)
        traceback.print_exc(file=sys.stdout)
        return 1
    print(f"{done} variants compiled for sm_90 (mode-2 kernels included)", flush=True)
    return 0


def real_records() -> dict:
    """On a GPU, where the benchmark's activations are: a 256-token and a 2048-token record, coded
    by element and by column."""
    if not ACTIVATIONS.exists():
        return {}
    from safetensors.torch import load_file

    acts = load_file(str(ACTIVATIONS))["bf16"]
    cuts = {"real-256": lambda: {"h": acts[:256].contiguous()}, "real-2048": lambda: {"h": acts[:2048].contiguous()}}
    return cuts | {f"cols-{name}": cut for name, cut in cuts.items()}  # and coded by column


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="case names, or all")
    ap.add_argument("--device", default="cpu", help="cpu (the interpreter) or cuda (compiled kernels)")
    ap.add_argument("--compile", action="store_true", help="only compile the kernel for sm_90 (no interpreter)")
    args = ap.parse_args(argv)
    if args.compile:
        return compile_for_sm90()
    device = torch.device(args.device)
    if (device.type == "cpu") != (os.environ.get("TRITON_INTERPRET") == "1"):
        print("run on the CPU with TRITON_INTERPRET=1 (Triton's interpreter), on CUDA without", file=sys.stderr)
        return 2
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    known = dict(RECORDS)
    if device.type == "cuda":  # sizes the interpreter would take minutes over
        known |= {**ON_GPU, **real_records()}
    damaged = {f"damaged-{n}": v for n, v in _damaged().items()}
    damaged |= {f"cols-damaged-{n}": v for n, v in _damaged_columns().items()}
    variants = {suffix: [n + suffix for n in cases] for suffix, (cases, _) in VARIANTS.items()}
    everything = [*known, *(n for v in variants.values() for n in v), "tensor-payloads", *damaged, "compiles-for-sm90"]
    names = args.cases
    if names == ["all"] or (not names and device.type == "cuda"):
        names = everything
    if not names:
        print("\n".join(everything))
        return 0
    unknown = [n for n in names if n not in everything]
    if unknown:
        print(f"unknown cases {unknown}: run with no argument for the list", flush=True)
        return 2
    compiling = start_compiling() if "compiles-for-sm90" in names else None
    failed = []
    if any(n in known for n in names):
        failed += check_decoding([n for n in names if n in known], known, device)
    for suffix, (_, settings) in VARIANTS.items():
        if any(n in variants[suffix] for n in names):
            failed += check_decoding([n for n in names if n in variants[suffix]], known, device, **settings)
    if "tensor-payloads" in names and not check_tensor_payloads("tensor-payloads", device):
        failed.append("tensor-payloads")
    failed += [n for n in names if n in damaged and not check_damaged(n, *damaged[n], device)]
    if compiling is not None and not check_compiles("compiles-for-sm90", compiling):
        failed.append("compiles-for-sm90")
    print(
        f"{len(names) - len(failed)} of {len(names)} cases ok on {device}"
        + (f", FAILED: {' '.join(failed)}" if failed else "")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
