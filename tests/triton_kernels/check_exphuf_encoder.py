"""Checks of the Triton encoder of exp-huf (``impl="triton"``, layertap.gpu.exphuf_triton) in
Triton's interpreter, on the CPU: each case's blocks equal the Rust encoder's (and a batch's
buffer equals the torch operations' one). Not collected by pytest: vLLM's CPU build must never
see triton, so tests/test_triton_exphuf_encoder.py runs this script in a subprocess with
``PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1``.

    PYTHONPATH=.venv/triton:python TRITON_INTERPRET=1 python tests/triton_kernels/check_exphuf_encoder.py CASE...
    PYTHONPATH=python python3 tests/triton_kernels/check_exphuf_encoder.py --device cuda   # on a GPU

``all`` runs every case (one start of torch and triton, the test's way: the interpreter's start
costs seconds); with no CASE, every case on CUDA, the list of cases on the CPU. Each case runs with the default blocks and, where
they would not cut a segment in several, with blocks of 128 elements (the interpreter takes
milliseconds a program): either way several blocks to a segment, a segment's last block short;
then, but for ``HOST_TABLES_ONLY``, with the code tables built on the device (``tables="device"``)
and the counts added by histograms (``exphuf_triton.COUNTS``). Prints ``ok CASE ...``
or ``FAIL CASE: ...`` (and the traceback) for each, and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from pathlib import Path

import torch

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))

from test_gpu_exphuf import CASES, NAMES, activations_like, reference  # noqa: E402

from layertap._spec import exphuf as spec  # noqa: E402
from layertap.gpu import exphuf, exphuf_triton  # noqa: E402

if os.environ.get("TRITON_INTERPRET") == "1":  # its frontend cheaper a step, same results: faster_interpreter.py
    import faster_interpreter

    faster_interpreter.install()

#: 64 tokens of all-MiniLM-L6-v2's bf16 hidden states ([64, 7, 384]), committed beside this
#: script (made by benches/activations.py) so that the real case runs wherever the suite runs.
ACTIVATIONS = Path(__file__).resolve().parent / "minilm-bf16-64-tokens.safetensors"


#: Cases whose tables are built on the host only: the interpreter takes seconds a table built
#: on the device, and their tables are of kinds the other cases build (per tensor, as in the
#: other bf16 and f16 cases).
HOST_TABLES_ONLY = {"batch", "F16-100x4x64"}


def case_name(shape, dtype) -> str:
    return f"{NAMES[dtype]}-{'x'.join(map(str, shape))}"


def edge_cases() -> dict:
    g = torch.Generator().manual_seed(0)
    return {
        "short": lambda: [torch.zeros(63, dtype=torch.bfloat16)],
        "one-symbol": lambda: [torch.full((300,), 1.5, dtype=torch.bfloat16)],
        "incompressible": lambda: [
            torch.randint(-(2**15), 2**15, (4096,), dtype=torch.int16, generator=g).view(torch.bfloat16)
        ],
        "special-values": lambda: [
            torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40] * 20, dtype=torch.float32)
        ],
        "tied-mode": lambda: [tied_mode()],
        "long-codes-f32": lambda: [long_codes_f32()],
        "batch": lambda: [
            activations_like((40, 3, 96), torch.bfloat16, seed=3),
            torch.zeros(10, dtype=torch.bfloat16),
            activations_like((7, 1000), torch.bfloat16, seed=4),
            torch.randint(-(2**15), 2**15, (2048,), dtype=torch.int16, generator=g).view(torch.bfloat16),
            activations_like((3000,), torch.bfloat16, seed=5) * 1e-30,
        ],
    }


def tied_mode() -> torch.Tensor:
    """bf16 [64, 32] whose sample holds two exponents equally often: the mode is the last of
    the tied (the Rust encoder's), and it sets the contexts of a coded block."""
    g = torch.Generator().manual_seed(1)
    exps = torch.where(torch.arange(64 * 32) % 2 == 0, 127, 129)
    mantissa = torch.randint(0, 128, (64 * 32,), generator=g)
    return ((exps << 7) | mantissa).to(torch.int16).view(torch.bfloat16).reshape(64, 32)


def long_codes_f32() -> torch.Tensor:
    """f32 whose rare exponents get 11-bit codes: a value of 11 + 23 bits that starts at bit 31
    of a word spans three words. Counts of powers of two over 16,384 elements: six symbols of 1
    to 6 bits' codes and 48 rare ones, 16 of 8 elements and 32 of 4 whose optimal code takes 12
    bits, so the code is limited to 11 (the device's bisection; 256 values of 11-bit codes). 54
    symbols: the device's Huffman builds take as many steps as the symbols, and the interpreter
    took 7.7 s on the 508 of exponents drawn at random."""
    g = torch.Generator().manual_seed(6)  # a seed whose order puts 13 values over three words
    # (sign, exponent) -> count
    counts = {(0, 127): 8192, (1, 127): 4096, (0, 126): 2048, (1, 126): 1024, (0, 125): 512, (1, 125): 256}
    rare = [(sign, exponent) for exponent in range(90, 114) for sign in (0, 1)]
    counts |= dict.fromkeys(rare[:16], 8) | dict.fromkeys(rare[16:48], 4)
    sign = torch.tensor([s for (s, _), k in counts.items() for _ in range(k)])
    exps = torch.tensor([e for (_, e), k in counts.items() for _ in range(k)])
    order = torch.randperm(len(sign), generator=g)
    sign, exps = sign[order], exps[order]
    mantissa = torch.randint(0, 1 << 23, (len(sign),), generator=g)
    x = ((sign << 31) | (exps << 23) | mantissa).to(torch.int64).to(torch.int32).view(torch.float32)
    lengths = _context0_lengths(reference(x))
    assert max(lengths) == 11, f"longest code {max(lengths)} bits: the case no longer tests 11-bit codes"
    spanning = _values_over_three_words(x, lengths)
    assert spanning, "no value spans three 32-bit words: the case no longer tests what it is for"
    return x


def _context0_lengths(block: bytes) -> list[int]:
    """The code lengths of context 0 of a coded block (mode 1), by symbol."""
    assert block[0] == spec.MODE_CODED, f"block mode {block[0]}"
    lengths, _ = spec._lengths(block, 1 + 8 + spec.SYMBOLS // 2)
    return lengths


def _values_over_three_words(x: torch.Tensor, lengths: list[int]) -> int:
    """The values of 1-D f32 ``x`` (one context: stride 0) whose code and 23 raw bits, in its
    stream of a block of 4, start late enough in a 32-bit word to end in the word after next."""
    import numpy as np

    top = (x.view(torch.int32).numpy().astype(np.int64) >> 23) & 511
    bits = np.array(lengths, np.int64)[spec.symbol_of_top(top)] + 23
    spanning = 0
    for k in range(4):
        seg = spec.segment(len(bits), 4, k)
        run = bits[seg.start : seg.stop]
        start = np.cumsum(run) - run
        spanning += int((start % 32 + run > 64).sum())
    return spanning


def code_tables_case(device: torch.device) -> None:
    """The code tables built on the device (``exphuf_triton.tables``) against the Rust core's,
    on counts the encoder's cases rarely make: equal counts (ties between leaves and merged
    nodes), counts whose optimal code passes 11 bits (the bisection), a lone symbol, none."""
    import numpy as np

    from layertap.gpu.exphuf import code_lengths, reversed_codes_of

    rng = np.random.default_rng(3)
    rows = [np.zeros(512, np.int64), np.eye(1, 512, 7, dtype=np.int64)[0] * 5]
    for k in range(6):  # few distinct counts: many ties
        rows.append(rng.integers(0, 4, 512) * (rng.random(512) < 0.1) * (k + 1))
    for _ in range(8):  # counts over 24 octaves: codes past 11 bits without the bisection, some
        # of whose last bisection step does not fit (so the build at the h found must come after)
        r = np.zeros(512, np.int64)
        m = int(rng.integers(20, 60))
        r[:m] = (2.0 ** rng.uniform(0, 24, m)).astype(np.int64) + 1
        rng.shuffle(r)
        rows.append(r)
    r = np.zeros(512, np.int64)
    r[100:140] = [2 ** min(i, 30) for i in range(40)]  # a chain: depth 39 at h = 0
    rows.append(r)
    counts = np.stack(rows).astype(np.int32)
    want_lengths = code_lengths(counts)
    want_codes = reversed_codes_of(want_lengths)
    lengths, codes = exphuf_triton.tables(torch.from_numpy(counts.reshape(-1).copy()).to(device))
    lengths = lengths.cpu().numpy().reshape(-1, 512)
    codes = codes.cpu().numpy().reshape(-1, 512).view(np.uint16)
    for i in range(len(rows)):
        if not (lengths[i] == want_lengths[i]).all() or not (codes[i] == want_codes[i]).all():
            d = np.nonzero((lengths[i] != want_lengths[i]) | (codes[i] != want_codes[i]))[0][:5]
            raise CaseFailed(
                f"FAIL code-tables: table {i}: symbols {d.tolist()} have lengths {lengths[i][d].tolist()} "
                f"codes {codes[i][d].tolist()}, the Rust core's {want_lengths[i][d].tolist()} {want_codes[i][d].tolist()}"
            )
    print(f"ok code-tables: {len(rows)} tables, longest code {int(want_lengths.max())} bits", flush=True)


def cases(device: torch.device) -> dict:
    out = {case_name(s, d): (lambda s=s, d=d: [activations_like(s, d)]) for s, d in CASES}
    out.update(edge_cases())
    # The interpreter takes seconds a 10,000 elements: 8 tokens a record there (21 blocks each).
    out["real"] = lambda: real_activations(32 if device.type == "cuda" else 8)
    out["code-tables"] = None  # (code_tables_case)
    out["compiles-for-sm90"] = None  # (compile_for_sm90, in a child process)
    return out


def real_activations(tokens: int) -> list[torch.Tensor]:
    """Two records of ``tokens`` tokens of all-MiniLM-L6-v2's bf16 hidden states ([tokens, 7, 384])."""
    from safetensors.torch import load_file

    acts = load_file(str(ACTIVATIONS))["bf16"]
    return [acts[tokens * k : tokens * (k + 1)].contiguous() for k in range(2)]


class CaseFailed(Exception):
    """A case whose bytes differ."""


def check(name: str, tensors: list[torch.Tensor], device: torch.device) -> None:
    """The case's blocks on ``device`` against the Rust encoder's of the same tensors."""
    dtype = NAMES[tensors[0].dtype]
    want = [reference(t) for t in tensors]
    tensors = [t.to(device) for t in tensors]
    # Blocks of 128 elements where the default ones would not cut a segment in several.
    small = max(t.numel() for t in tensors) <= 4 * exphuf_triton.BLOCK
    for block in (128, exphuf_triton.BLOCK) if small else (exphuf_triton.BLOCK,):
        exphuf_triton_block = exphuf_triton.BLOCK
        exphuf_triton.BLOCK = block
        try:
            t0 = time.perf_counter()
            blocks = exphuf.encode_blocks(tensors, dtype, impl="triton")
            buf, sizes = exphuf.encode_contiguous(tensors, dtype, impl="triton")
            took = time.perf_counter() - t0
        finally:
            exphuf_triton.BLOCK = exphuf_triton_block
        got = [b.to_bytes() for b in blocks]
        for k, (g, w) in enumerate(zip(got, want)):
            if g != w:
                at = next((j for j, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
                raise CaseFailed(
                    f"FAIL {name} (blocks of {block}): tensor {k} {tuple(tensors[k].shape)}: "
                    f"{len(g)} bytes against the Rust encoder's {len(w)}, first difference at byte {at}"
                )
        if sizes != [len(w) for w in want] or buf.cpu().numpy().tobytes() != b"".join(want):
            raise CaseFailed(f"FAIL {name} (blocks of {block}): encode_contiguous differs from the Rust blocks")
        torch_buf, torch_sizes = exphuf.encode_contiguous(tensors, dtype, impl="torch")
        if torch_sizes != sizes or torch_buf.cpu().numpy().tobytes() != buf.cpu().numpy().tobytes():
            raise CaseFailed(f"FAIL {name} (blocks of {block}): the torch operations' buffer differs")
        for t, g in zip(tensors, got):
            values, end = spec.decode_block(g, 0, t.numel(), t.element_size())
            if end != len(g) or bytes(memoryview(values)) != t.reshape(-1).view(torch.uint8).cpu().numpy().tobytes():
                raise CaseFailed(f"FAIL {name}: the reference decoder does not give {tuple(t.shape)} back")
        modes = [b.head[0] for b in blocks]
        print(f"ok {name} blocks of {block}: {len(tensors)} tensors, modes {modes}, {took:.2f} s", flush=True)
    if name in HOST_TABLES_ONLY:
        return
    # The code tables built on the device, the counts added by histograms: the same bytes.
    t0 = time.perf_counter()
    exphuf_triton.COUNTS = "histogram"
    try:
        buf, sizes = exphuf.encode_contiguous(tensors, dtype, impl="triton", tables="device")
    finally:
        exphuf_triton.COUNTS = "atomic"
    took = time.perf_counter() - t0
    if sizes != [len(w) for w in want] or buf.cpu().numpy().tobytes() != b"".join(want):
        raise CaseFailed(
            f"FAIL {name} (tables on the device, histogram counts): encode_contiguous differs from the Rust blocks"
        )
    print(f"ok {name} tables on the device, histogram counts: {took:.2f} s", flush=True)


#: The kernels' launches the encoder makes, as ``(kernel, its pointers' types, its other
#: arguments' types, constexprs, num_warps)``: every dtype's constants (BF16, F16, F32: 2- or
#: 4-byte elements, exponent shift 0 or 3), both ways of adding the counts, and the device
#: tables' three kernels, with the values and types ``exphuf_triton`` launches them with.
def launches() -> list:
    k = exphuf_triton
    scratch = {"w_ptr": "*i64", "p_ptr": "*i64", "d_ptr": "*i64"}
    lengths = {"sorted_ptr": "*i64", "n_ptr": "*i64", "n_tables": "i32", **scratch, "lengths_ptr": "*u8"}
    out = [
        (k._sort_counts_kernel, {"counts_ptr": "*i32", "sorted_ptr": "*i64", "n_ptr": "*i64"}, {"RC": 32}, 8, "tables"),
        (k._code_lengths_kernel, lengths, {"TB": k.TABLES_PER_PROGRAM, "CH": k._LEAF_CHUNK}, 1, "tables"),
        (k._reversed_codes_kernel, {"lengths_ptr": "*u8", "codes_ptr": "*i16"}, {}, 4, "tables"),
    ]
    elements = ["x_ptr", "ctx_ptr", "blk_seg_ptr", "seg_first_ptr", "seg_start_ptr", "seg_end_ptr", "seg_stride_ptr"]
    for dtype, (width, exp_shift) in spec.CODED.items():
        x = "*i16" if width == 2 else "*i32"
        consts = {"MASK": (1 << (8 * width)) - 1, "RAW_BITS": 8 * width - 9}
        el = {**dict.fromkeys(elements, "*i64"), "x_ptr": x, "ctx_ptr": "*i32"}
        per_tensor = {"x_ptr": x, "base_ptr": "*i64", "n_ptr": "*i64", "step_ptr": "*i64", "mode_ptr": "*i32", "ctx_ptr": "*i32"}  # fmt: skip
        out.append((k._sample_contexts_kernel, per_tensor, {**consts, "EXP_SHIFT": exp_shift, "SAMPLE_BLOCK": k.SAMPLE_BLOCK}, 4, dtype))  # fmt: skip
        if dtype == "F16":  # the same kernels as BF16's past kernel 1 (EXP_SHIFT is kernel 1's only)
            continue
        for histogram in (False, True):
            out.append((k._count_symbols_kernel, {**el, "counts_ptr": "*i32"}, {**consts, "BLOCK": k.BLOCK, "HISTOGRAM": histogram}, 4, dtype))  # fmt: skip
        out.append((k._block_bits_kernel, {**el, "len_ptr": "*u8", "blk_bits_ptr": "*i64"}, {**consts, "BLOCK": k.BLOCK}, 4, dtype))  # fmt: skip
        pack = {**el, "len_ptr": "*u8", "code_ptr": "*i16", "blk_before_ptr": "*i64", "seg_base_ptr": "*i64", "words_ptr": "*i32"}  # fmt: skip
        out.append((k._pack_kernel, pack, {**consts, "BLOCK": k.BLOCK}, 4, dtype))
    return out


#: The most PTX (characters) a kernel variant may come to. The code-length kernel with its
#: Huffman build inlined nine times came to 9.5 M and took 6 minutes to compile (362 s on this
#: machine, 2026-12-05), so the GPU's first call with device tables ran out of time before its
#: first launch; with one build in a runtime loop it comes to 0.4 M (4 s; 1.7 M and 18 s with
#: its loops over the leaves unrolled). The largest variant now is kernel 2 with histogram
#: counts, 0.7 M. A size, not a time: the same on a loaded machine.
PTX_LIMIT = 1_000_000


def start_compiling():
    """Every kernel the encoder launches compiled to an H200's code (sm_90, with the ptxas triton
    ships), no GPU needed: the interpreter accepts what the compiler refuses (a plain Python
    global read in a kernel, for one, which failed the device tables on the GPU). In a child
    process without the interpreter (which takes triton.language over), started first so that it
    runs beside the interpreter's cases."""
    import subprocess

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.Popen(
        [sys.executable, __file__, "--compile"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )


def compile_for_sm90() -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    t0 = time.perf_counter()
    done, took = 0, []
    for kernel, pointers, constants, warps, what in launches():
        t1 = time.perf_counter()
        try:
            signature = {**pointers, **dict.fromkeys(constants, "constexpr")}
            assert list(signature) == kernel.arg_names, f"arguments {kernel.arg_names}, the check's {list(signature)}"
            source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
            options = {"num_warps": warps, "num_stages": 1}
            compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
            assert compiled.asm["cubin"], "no cubin"
            ptx = len(compiled.asm["ptx"])
            assert ptx <= PTX_LIMIT, f"{ptx} characters of PTX, more than {PTX_LIMIT} (PTX_LIMIT): slow to compile"
            done += 1
            took.append(
                f"{kernel.__name__.strip('_')} {what} {time.perf_counter() - t1:.1f} s, {ptx // 1000} kB of PTX"
            )
        except Exception:
            print(f"{kernel.__name__} ({what}, {constants}) does not compile:", flush=True)
            traceback.print_exc(file=sys.stdout)
            return 1
    print(
        f"{done} kernel variants compiled for sm_90 in {time.perf_counter() - t0:.0f} s ({', '.join(took)})", flush=True
    )
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="case names, or all")
    ap.add_argument("--device", default="cpu", help="cpu (the interpreter) or cuda (compiled kernels)")
    ap.add_argument("--compile", action="store_true", help="only compile the kernels for sm_90 (no interpreter)")
    args = ap.parse_args(argv)
    if args.compile:
        return compile_for_sm90()
    if args.cases == ["compiles-for-sm90"] and os.environ.get("TRITON_INTERPRET") != "1":  # the compiler alone
        failed = compile_for_sm90()
        print(f"{'FAIL' if failed else 'ok'} compiles-for-sm90")
        return failed
    device = torch.device(args.device)
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        print("on the CPU, run with TRITON_INTERPRET=1 (Triton's interpreter)", file=sys.stderr)
        return 2
    if device.type == "cuda" and os.environ.get("TRITON_INTERPRET") == "1":
        print("on CUDA, run without TRITON_INTERPRET (compiled kernels)", file=sys.stderr)
        return 2
    if exphuf.default_impl(device) != "triton":
        print("triton does not import: PYTHONPATH must hold .venv/triton", file=sys.stderr)
        return 2
    known = cases(device)
    names = args.cases
    if names == ["all"] or (not names and device.type == "cuda"):
        names = list(known)
    if not names:
        print("\n".join(known))
        return 0
    unknown = [name for name in names if name not in known]
    if unknown:
        print(f"no case {unknown[0]!r}; the cases: {', '.join(known)}", file=sys.stderr)
        return 2
    compiling = start_compiling() if "compiles-for-sm90" in names else None
    failed = 0
    for name in names:
        try:
            if name == "compiles-for-sm90":
                continue  # (its child's answer is read last)
            if name == "code-tables":
                code_tables_case(device)
                continue
            check(name, known[name](), device)
        except CaseFailed as e:
            print(e, flush=True)
            failed += 1
        except Exception:
            print(f"FAIL {name}: raised", flush=True)
            traceback.print_exc(file=sys.stdout)
            failed += 1
    if compiling is not None:
        out, _ = compiling.communicate()
        print(
            f"ok compiles-for-sm90: {out.strip()}" if compiling.returncode == 0 else f"FAIL compiles-for-sm90:\n{out}"
        )
        failed += compiling.returncode != 0
    print(f"{len(names) - failed} of {len(names)} cases ok on {device}" + (f", {failed} FAILED" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
