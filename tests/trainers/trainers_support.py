"""Helpers of the trainer-integration tests (speculators, SpecForge): a tiny verifier whose
final norm has non-trivial weights, its true hidden states (transformers), prepared rows, and
layertap datasets keyed by row index written with ``ShardWriter``. Fixtures are in conftest.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
#: SpecForge 0.2.0's wheel, installed without its dependencies (it pins torch 2.11 and sglang)
#: by `make venv` (Makefile; requirements-specforge.txt).
SPECFORGE_TARGET = REPO / ".venv" / "specforge"
#: NVIDIA Model-Optimizer 0.47.0 and the transformers it runs with, installed without
#: dependencies beside the virtualenv running the tests (`make venv`: $(VENV)/modelopt;
#: requirements-modelopt.txt says why not into it).
MODELOPT_TARGET = Path(sys.prefix) / "modelopt"
#: vLLM layer ids the datasets of these tests hold (the tiny model has N = 4 layers): speculators'
#: and EAGLE-3's [2, N//2, N-3, N] would repeat layer 2, so the aux layers are 1, 2, 3.
LAYERS = [1, 2, 3, 4]
N = 4


def build_verifier(path: str | os.PathLike, dtype: str = "float32") -> str:
    """The tiny Llama of tests/tiny_llama.py with a random final-norm weight (the built one is
    all ones, which would hide a norm applied without its weight)."""
    from safetensors.torch import load_file, save_file

    from tiny_llama import build_tiny_llama

    model_dir = build_tiny_llama(path, dtype=dtype)
    ckpt = os.path.join(model_dir, "model.safetensors")
    weights = load_file(ckpt)
    g = torch.Generator().manual_seed(7)
    w = weights["model.norm.weight"]
    weights["model.norm.weight"] = (0.5 + torch.rand(w.shape, generator=g)).to(w.dtype)
    save_file(weights, ckpt, metadata={"format": "pt"})
    return model_dir


class Truth:
    """What transformers computes for the verifier: per vLLM layer id the hidden states, and the
    last hidden state after the final norm."""

    def __init__(self, model_dir: str):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self._last: dict = {}

        def keep(_m, _i, out):
            self._last["x"] = out[0] if isinstance(out, tuple) else out

        self.model.model.layers[-1].register_forward_hook(keep)

    def states(self, token_ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """``([T, N+1, H]`` by vLLM id 0..N, ``[T, H]`` after the final norm)."""
        with torch.no_grad():
            out = self.model(torch.tensor([token_ids]), output_hidden_states=True)
        n = self.model.config.num_hidden_layers
        per_id = [out.hidden_states[k][0] for k in range(n)] + [self._last["x"][0]]
        return torch.stack(per_id, 1), out.hidden_states[n][0]


def prepared_rows(count: int, seed: int = 0, vocab: int = 500) -> list[dict]:
    """Rows like speculators' prepared data: input_ids, loss_mask (0 on a prompt prefix), seq_len."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        n = 12 + (i * 5) % 23
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        mask = [0] * 4 + [1] * (n - 4)
        rows.append({"input_ids": ids, "loss_mask": mask, "seq_len": n})
    return rows


def write_dataset(
    out: str | os.PathLike,
    rows: list[dict],
    truth: Truth,
    *,
    layers: list[int] = LAYERS,
    dtype: torch.dtype = torch.bfloat16,
    keys: list[str] | None = None,
    loss_mask: bool = True,
    writer_id: str | None = None,
    lossy: str | None = None,
) -> None:
    """A layertap dataset like `layertap generate`'s: record key = row index, hidden_states of
    ``layers`` (vLLM ids) in ``dtype``, token_ids, the row's loss_mask (uint8) and metadata."""
    import layertap

    with layertap.ShardWriter(
        str(out),
        writer_id=writer_id,
        lossy=lossy,
        metadata={"source": "layertap.generate", "layer_numbering": "vllm", "layer_ids": json.dumps(layers)},
    ) as w:
        for i, row in enumerate(rows):
            key = str(i) if keys is None else keys[i]
            states, _ = truth.states(row["input_ids"])
            tensors = {
                "hidden_states": states[:, layers].to(dtype).contiguous(),
                "token_ids": torch.tensor(row["input_ids"], dtype=torch.int64),
            }
            if loss_mask:
                tensors["loss_mask"] = torch.tensor(row["loss_mask"], dtype=torch.uint8)
            w.submit(
                key,
                tensors,
                metadata={"layer_ids": json.dumps(layers), "row": key, "dtype": str(dtype).removeprefix("torch.")},
            )


def save_prepared(path: str | os.PathLike, rows: list[dict]) -> str:
    """``rows`` as speculators' prepare-data saves them (a datasets directory, torch format)."""
    import datasets

    ds = datasets.Dataset.from_list(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(path))
    return str(path)


def layertap_cli(*args: str, check: bool = False, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "layertap", *map(str, args)], capture_output=True, text=True, timeout=240, **kw
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"layertap {' '.join(map(str, args))} exited {proc.returncode}:\n{proc.stderr}")
    return proc
