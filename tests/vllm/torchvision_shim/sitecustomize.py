"""Lets torchvision 0.28's Python part import beside torch's CPU build, for the vision-language
test's engine process only (tests/vllm/test_vision_language.py puts this folder on PYTHONPATH
before requirements-torchvision.txt's folder; Python imports ``sitecustomize`` at start-up, so
vLLM's own child processes, such as its model inspection, get it too).

PyPI's torchvision is a CUDA build: its ``_C.so`` links libcudart and torch's CUDA libraries,
so loading it fails, which torchvision tolerates (``extension._has_ops()`` turns False) except in
``_meta_registrations``, whose two ``torch.library.register_fake("torchvision::nms")`` and
``("torchvision::qnms")`` do not check it and stop the import with "operator torchvision::nms
does not exist". Defining those two operators' schemas (the ones ``_C`` would define) lets the
import go on; calling them still fails, as their kernels are in ``_C``. Qwen2-VL's processors use
only torchvision's tensor transforms, which are torch operations.
"""

import torch

_NMS_SCHEMA = "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
for _name in ("nms", "qnms"):
    try:
        torch.library.define(f"torchvision::{_name}", _NMS_SCHEMA)
    except RuntimeError:  # already defined: torchvision's _C did load, nothing to do
        pass
