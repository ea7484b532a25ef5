"""fp8 against speculators' own quantizer, on real activations (issue 25 item 2).

Quantizes all-MiniLM-L6-v2's activations (benches/activations.py, bf16 ``[tokens, 7, 384]``)
to float8 e4m3 with a scale per token twice: through layertap's Rust writer
(``lossy="fp8-e4m3"``, written to a shard and read back) and with hs-connectors'
``quantize_tensor_to_fp8`` (speculators' fp8 backend). Reports whether the e4m3 bytes and the
scales are equal, and each one's error against the bf16 input after each dequantization:
layertap's (``layertap.fp8.dequantize``: float32 product, rounded once to bf16) and hs-connectors'
(``dequantize_fp8_tensor``: the scale rounded to bf16 first, a bf16 product), which speculators'
fp8 backend and layertap's speculators backend hand a trainer.

    python benches/fp8_speculators.py [--out benches/results/fp8-speculators-cpu2.md]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent


def errors(x, y) -> dict[str, float]:
    """Relative errors of ``y`` against ``x`` (float32 views), as FP8.md defines them."""
    x, y = x.float(), y.float()
    nz = x != 0
    rel = (y - x).abs()[nz] / x.abs()[nz]
    return {
        "rms": float((y - x).norm() / x.norm()),
        "mean": float(rel.mean()),
        "p99": float(rel.kthvalue(max(1, int(0.99 * rel.numel()))).values),  # quantile() stops at 16M
        "max": float(rel.max()),
        "zeroed": float(((y == 0) & nz).float().mean()),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "fp8-speculators-cpu2.md")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens of the activations to use")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(HERE))
    import activations

    activations.main([])
    import torch
    from safetensors.torch import load_file

    import layertap
    from layertap.fp8 import SCALE_NAME, dequantize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from hs_connectors.fp8_utils import dequantize_fp8_tensor, quantize_tensor_to_fp8

    bf16 = load_file(str(activations.DEFAULT_OUT))["bf16"][: args.tokens].contiguous()
    with tempfile.TemporaryDirectory() as tmp:
        with layertap.ShardWriter(tmp, lossy="fp8-e4m3") as w:
            w.submit("a", {"hidden_states": bf16}, metadata={"dtype": "bfloat16"})
        with layertap.open(tmp) as ds:
            rec = ds["a"]
            ours_q, ours_s = rec.hidden_states.clone(), rec.tensors[SCALE_NAME].clone()
    their_q, their_s = quantize_tensor_to_fp8(bf16)
    same_bytes = torch.equal(ours_q.view(torch.uint8), their_q.view(torch.uint8))
    same_scales = torch.equal(ours_s, their_s.reshape(-1))
    rows = [
        ("layertap writer, layertap.fp8.dequantize (f32 product)", errors(bf16, dequantize(ours_q, ours_s))),
        (
            "layertap writer, hs-connectors dequantize (bf16 product; both speculators backends)",
            errors(bf16, dequantize_fp8_tensor(ours_q, ours_s.reshape(-1, 1, 1))),
        ),
        (
            "hs-connectors quantize_tensor_to_fp8 + its dequantize",
            errors(bf16, dequantize_fp8_tensor(their_q, their_s)),
        ),
    ]
    lines = [
        "# fp8-e4m3: layertap's quantizer beside speculators' (hs-connectors 0.9.0)",
        "",
        f"all-MiniLM-L6-v2 activations, bf16 {list(bf16.shape)} (benches/activations.py); "
        f"`python benches/fp8_speculators.py`. Errors relative to the bf16 input, over its non-zero "
        "elements (rms: norm of the error over norm of the input; zeroed: share of non-zero inputs that "
        "became 0).",
        "",
        f"- e4m3 bytes equal: **{same_bytes}**; scales equal: **{same_scales}**",
        "",
        "| quantizer, dequantization | rms rel | mean rel | p99 rel | max rel | zeroed |",
        "|---|---|---|---|---|---|",
    ]
    for name, e in rows:
        lines.append(
            f"| {name} | {e['rms']:.5f} | {e['mean']:.5f} | {e['p99']:.4f} | {e['max']:.4f} | {e['zeroed']:.5f} |"
        )
    text = "\n".join(lines) + "\n"
    args.out.write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
