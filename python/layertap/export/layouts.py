"""What an export writes for each row: the file layouts of speculators, SpecForge and NVIDIA
Model-Optimizer, whose tensors docs/TRAINING.md tabulates.

Layer ids are vLLM's throughout (docs/CONNECTOR.md): for a model of N decoder layers, id k < N is
the input of decoder layer k and id N the last decoder layer's output before the final norm.
SGLang, SpecForge and Model-Optimizer number the same states one lower: their layer j is the
output of decoder layer j, vLLM's j + 1 (SpecForge's EAGLE-3 default ``[1, N//2-1, N-4]`` is
vLLM's ``[2, N//2, N-3]``).

- ``SpeculatorsLayout``: ``OUT/hidden_states/hs_{row}.safetensors``, which speculators' file
  backend reads (OUT its ``--data-path``); in fp8, its fp8 backend's layout, with a scale per
  token (hs-connectors' ``fp8_hidden_states_connector``).
- ``SpecForgeLayout``: ``OUT/rows_{g}-{g+2000}/data_{row}.ckpt``, the ``torch.save`` files of
  SpecForge's ``scripts/prepare_hidden_states.py`` (EAGLE-3 or DFlash); with ``compress``
  (its ``--compress``) ``data_{row}.ckpt.gz``, which its loaders gunzip before ``torch.load``.
- ``ModelOptLayout``: ``OUT/{row}.pt``, as Model-Optimizer's ``compute_hidden_states_hf.py``
  writes them and its ``OfflineSupervisedDataset`` reads them (EAGLE-3 offline training); the
  last layer after the final norm, or before it with ``hidden_states_prenorm=True``, for
  Model-Optimizer 0.46 and later to apply the norm themselves.

A dataset stored as fp8 (docs/FP8.md) reaches SpecForge and Model-Optimizer dequantized, in the
dtype the writer was given (its ``fp8_source_dtype``, else bfloat16) unless ``dtype`` says
otherwise; speculators gets it as stored, with its scales, unless ``dtype`` names a float type.
"""

from __future__ import annotations

import io
import os
from dataclasses import dataclass
from typing import Any

from layertap._spec.record import HIDDEN_STATES, LOSS_MASK, REDUCTION, TOKEN_IDS, WINDOW_END, WINDOW_START
from layertap.errors import InvalidInputError
from layertap.export.files import gzipped
from layertap.fp8 import SCALE_NAME

#: Rows per subdirectory of a SpecForge export (its --file-group-size default).
SPECFORGE_GROUP = 2000
#: gzip level of SpecForge's ``prepare_hidden_states.py --compress`` (its --compression-level default).
SPECFORGE_GZIP_LEVEL = 6
#: The fp8 dtype, which only speculators' layout takes (its fp8 backend's).
FP8 = "float8_e4m3fn"
DTYPES = ("stored", "bfloat16", "float16", "float32", FP8)
#: The scales tensor of speculators' fp8 layout (hs-connectors' ``fp8_utils.SCALES_KEY``).
SPECULATORS_SCALES = "hidden_states_scales"


class RecordProblem(Exception):
    """A record the export cannot use (named in the summary; its row gets no file)."""


class Skip(Exception):
    """A record the trainer would refuse; its row gets no file (counted in the summary)."""


@dataclass
class Row:
    """One record's tensors, checked: what every layout builds from."""

    row: int
    token_ids: Any  # int64 [T]
    hidden_states: Any  # [T, L, H]
    layer_ids: list[int]
    loss_mask: Any  # [T] or None
    scale: Any = None  # float32 [T] when hidden_states are fp8 (docs/FP8.md), else None

    def floats(self) -> Any:
        """``hidden_states`` as floats: dequantized (float32) when stored as fp8, so that no
        layout casts fp8 values without their scales."""
        if self.scale is None:
            return self.hidden_states
        import torch

        from layertap.fp8 import dequantize

        return dequantize(self.hidden_states, self.scale, dtype=torch.float32)


def check_record(row: int, record: Any, layer_ids: list[int]) -> Row:
    """The tensors of ``record`` (the record of row ``row``), or ``RecordProblem`` saying what is
    wrong with them. ``layer_ids``: the layers every record of the export must have."""
    import torch

    meta = record.metadata
    if meta.get(REDUCTION):
        raise RecordProblem(
            f"a {meta[REDUCTION]} over positions [{meta.get(WINDOW_START)}, {meta.get(WINDOW_END)}) "
            "(a capture window's reduction): one vector, not the sequence a drafter trains on"
        )
    if meta.get(WINDOW_START, "0") != "0":
        raise RecordProblem(
            f"holds positions [{meta[WINDOW_START]}, {meta.get(WINDOW_END)}) of its sequence only "
            "(a capture window): drafters train on sequences from their start; record it without --window"
        )
    hs, ids = record.tensors.get(HIDDEN_STATES), record.tensors.get(TOKEN_IDS)
    if hs is None or ids is None:
        raise RecordProblem("no hidden_states or no token_ids tensor")
    if hs.dim() != 3 or ids.dim() != 1 or hs.shape[0] != ids.shape[0]:
        raise RecordProblem(
            f"hidden_states {list(hs.shape)} and token_ids {list(ids.shape)}: expected [T, layers, hidden] and [T]"
        )
    if ids.dtype != torch.int64:
        raise RecordProblem(f"token_ids are {ids.dtype}, not int64")
    try:
        ids_of_record = record.layer_ids
    except Exception as e:  # a FormatError naming the bad metadata
        raise RecordProblem(str(e)) from None
    if ids_of_record != layer_ids:
        raise RecordProblem(f"layer ids {ids_of_record}, not {layer_ids} like the export's first record")
    if hs.shape[1] != len(layer_ids):
        raise RecordProblem(f"hidden_states hold {hs.shape[1]} layers but layer_ids name {len(layer_ids)}")
    mask = record.tensors.get(LOSS_MASK)
    if mask is not None:
        if mask.shape != ids.shape:
            raise RecordProblem(f"loss_mask {list(mask.shape)} does not match token_ids {list(ids.shape)}")
        if bool(((mask != 0) & (mask != 1)).any()):
            raise RecordProblem("loss_mask holds values other than 0 and 1")
    scale = record.tensors.get(SCALE_NAME)
    if scale is not None and (scale.dtype != torch.float32 or list(scale.shape) != [hs.shape[0]]):
        raise RecordProblem(f"{SCALE_NAME} {scale.dtype} {list(scale.shape)}: expected float32 [{hs.shape[0]}]")
    if (scale is None) != (hs.dtype != torch.float8_e4m3fn):
        raise RecordProblem(f"hidden_states of {hs.dtype} with{'' if scale is not None else 'out'} {SCALE_NAME}")
    return Row(row, ids, hs, layer_ids, mask, scale)


def stored_float_dtype(first: Any) -> Any:
    """The torch dtype an export calls "stored" for a dataset whose first record is ``first``:
    for fp8 records, the dtype they were quantized from (``fp8_source_dtype``, else bfloat16),
    which the layouts that cannot take fp8 dequantize to."""
    import torch

    stored = first.tensors[HIDDEN_STATES].dtype
    if stored != torch.float8_e4m3fn:
        return stored
    source = getattr(torch, first.metadata.get("fp8_source_dtype", "bfloat16"), None)
    return source if isinstance(source, torch.dtype) and source.is_floating_point else torch.bfloat16


def _dtype(name: str, stored: Any, layout: str = "") -> Any:
    import torch

    if name == FP8 and layout != "speculators":
        raise InvalidInputError(
            f"--dtype {FP8}: only --to speculators stores fp8 (its fp8 backend's layout); {layout} takes "
            "bfloat16, float16 or float32"
        )
    return stored if name == "stored" else getattr(torch, name)


def _pick(layer_ids: list[int], wanted: list[int] | None) -> list[int]:
    """Positions in ``layer_ids`` of the ``wanted`` layers (all when None)."""
    if wanted is None:
        return list(range(len(layer_ids)))
    absent = [w for w in wanted if w not in layer_ids]
    if absent:
        raise InvalidInputError(f"--layers: the dataset has no layer {absent} (it has {layer_ids})")
    if len(set(wanted)) != len(wanted):
        raise InvalidInputError(f"--layers {wanted}: a layer is named twice")
    return [layer_ids.index(w) for w in wanted]


def specforge_ids(vllm_ids: list[int]) -> list[int]:
    """vLLM layer ids in SGLang/SpecForge numbering (one lower)."""
    return [i - 1 for i in vllm_ids]


#: Model-Optimizer numbers layers as SGLang does: its aux id j is the output of decoder layer j.
modelopt_ids = specforge_ids


def modelopt_default_aux(num_layers: int) -> list[int]:
    """Model-Optimizer's default EAGLE-3 aux layer ids for a model of ``num_layers`` decoder
    layers, in its numbering (``hf_eagle.default_eagle_aux_layer_ids``: near the start, the
    middle and the end, deduplicated for small models)."""
    return sorted({1, max(0, num_layers // 2 - 1), max(0, num_layers - 4)})


def _compact(t: Any) -> Any:
    """``t`` in storage of its own: ``torch.save`` writes a view's whole storage."""
    t = t.contiguous()
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


def _dtype_name(dtype: Any) -> str:
    return str(dtype).removeprefix("torch.")


def _torch_saved(tensors: dict) -> bytes:
    import torch

    buf = io.BytesIO()
    torch.save(tensors, buf)
    return buf.getvalue()


class SpeculatorsLayout:
    """speculators' cached hidden states: ``hs_{row}.safetensors`` under ``OUT/hidden_states``."""

    name = "speculators"
    fills_loss_mask = False

    def __init__(
        self,
        out: str,
        layer_ids: list[int],
        stored_dtype: Any,
        *,
        layers: list[int] | None = None,
        dtype: str = "stored",
        num_layers: int | None = None,
        fp8_stored: bool = False,
    ):
        """``fp8_stored``: the dataset holds fp8 records, which "stored" keeps as they are."""
        import torch

        self.root = os.path.join(out, "hidden_states")
        self.take = _pick(layer_ids, layers)
        self.layer_ids = [layer_ids[i] for i in self.take]
        if num_layers is not None and self.layer_ids[-1] != num_layers:
            raise InvalidInputError(
                f"speculators takes the last exported layer as the verifier's last hidden state, layer "
                f"{num_layers} (N) of this model, but the last is {self.layer_ids[-1]} (layers {self.layer_ids})"
            )
        self.dtype = torch.float8_e4m3fn if dtype == "stored" and fp8_stored else _dtype(dtype, stored_dtype, self.name)
        self.fp8 = self.dtype == torch.float8_e4m3fn
        self.settings = {"format": "speculators", "layer_ids": self.layer_ids, "dtype": _dtype_name(self.dtype)}
        self.describe = (
            f"hs_{{row}}.safetensors: hidden_states [T, {len(self.layer_ids)}, H] {self.settings['dtype']} "
            f"(layers {self.layer_ids}), token_ids [T]" + (f", {SPECULATORS_SCALES} [T, 1, 1]" if self.fp8 else "")
        )

    def relpath(self, row: int) -> str:
        return f"hs_{row}.safetensors"

    def build(self, r: Row) -> dict:
        def exported(hs: Any) -> Any:  # no copy when every layer is exported
            return hs if self.take == list(range(hs.shape[1])) else hs[:, self.take]

        token_ids = r.token_ids.contiguous()
        if not self.fp8:
            return {"hidden_states": exported(r.floats()).to(self.dtype).contiguous(), "token_ids": token_ids}
        if r.scale is None:
            # Quantized as hs-connectors' quantize_tensor_to_fp8 does (the same e4m3 bytes and
            # scales, tests/trainers/test_speculators_fp8.py), over the exported layers.
            from layertap.fp8 import quantize

            q, scale, _ = quantize(exported(r.hidden_states))
        else:
            # The stored bytes and scales, whose tokens' largest magnitudes may lie in a layer
            # left out: the values dequantize all the same.
            q, scale = exported(r.hidden_states), r.scale
        return {
            "hidden_states": q.contiguous(),
            SPECULATORS_SCALES: scale.reshape(-1, 1, 1).contiguous(),
            "token_ids": token_ids,
        }

    def serialize(self, tensors: dict, row: int) -> bytes:
        import json

        from safetensors.torch import save

        return save(
            tensors, metadata={"row": str(row), "layer_ids": json.dumps(self.layer_ids), "source": "layertap export"}
        )


class SpecForgeLayout:
    """SpecForge's offline features: ``rows_{g}-{g+2000}/data_{row}.ckpt`` (EAGLE-3 or DFlash)."""

    name = "specforge"
    fills_loss_mask = True

    def __init__(
        self,
        out: str,
        layer_ids: list[int],
        stored_dtype: Any,
        *,
        strategy: str = "eagle3",
        layers: list[int] | None = None,
        dtype: str = "bfloat16",
        norm: Any = None,
        num_layers: int | None = None,
        compress: int | None = None,
    ):
        """``compress``: a gzip level (1-9) to write ``.ckpt.gz`` files, as SpecForge's
        ``--compress --compression-level`` do; None writes ``.ckpt``."""
        self.root, self.strategy, self.compress, self.norm = out, strategy, compress, norm
        self.suffix = ".ckpt" if compress is None else ".ckpt.gz"
        self.dtype = _dtype(dtype, stored_dtype, self.name)
        file = "data_{row}.ckpt:" if compress is None else f"data_{{row}}.ckpt.gz (gzip level {compress}):"
        if strategy == "eagle3":
            if norm is None or num_layers is None:
                raise InvalidInputError("--strategy eagle3 needs --model (the final norm's weights)")
            if num_layers not in layer_ids:
                raise InvalidInputError(
                    f"EAGLE-3's hidden_state is the last layer after the final norm: the dataset needs layer "
                    f"{num_layers} (N, the last decoder layer's output) but has {layer_ids}"
                )
            aux = [i for i in layer_ids if i != num_layers] if layers is None else layers
            if num_layers in aux:
                raise InvalidInputError(
                    f"--layers {aux}: layer {num_layers} (N) is the hidden_state, not an auxiliary layer"
                )
            self.take = _pick(layer_ids, aux)
            self.last = layer_ids.index(num_layers)
            self.layer_ids = [layer_ids[i] for i in self.take]
            if len(self.take) != 3:
                raise InvalidInputError(
                    f"EAGLE-3 takes 3 auxiliary layers, the dataset gives {len(self.take)} "
                    f"({self.layer_ids}): choose them with --layers"
                )
            self.describe = (
                f"{file} input_ids, loss_mask, aux_hidden_state [1, S, 3H] (vLLM layers "
                f"{self.layer_ids} = SpecForge {specforge_ids(self.layer_ids)}), hidden_state [1, S, H] "
                f"(layer {num_layers} after {norm.kind})"
            )
        elif strategy == "dflash":
            self.take = _pick(layer_ids, layers)
            self.layer_ids = [layer_ids[i] for i in self.take]
            self.describe = (
                f"{file} input_ids, loss_mask, hidden_states [1, S, {len(self.layer_ids)}H] "
                f"(vLLM layers {self.layer_ids} = SpecForge target_layer_ids {specforge_ids(self.layer_ids)})"
            )
        else:
            raise InvalidInputError(f"--strategy must be eagle3 or dflash, not {strategy!r}")
        if 0 in self.layer_ids:
            raise InvalidInputError(
                "vLLM layer 0 (the embeddings) has no SGLang/SpecForge layer number: leave it out with --layers"
            )
        if num_layers is not None and max(self.layer_ids) > num_layers:
            raise InvalidInputError(f"layer ids {self.layer_ids} exceed the model's {num_layers} layers")
        # "compress" is always a setting (None when plain), so that a plain rerun of a gzipped
        # export (or the reverse) is refused rather than leaving both files of a row, which
        # SpecForge would both read.
        self.settings = {
            "format": "specforge",
            "strategy": strategy,
            "layer_ids": self.layer_ids,
            "specforge_layer_ids": specforge_ids(self.layer_ids),
            "dtype": _dtype_name(self.dtype),
            "compress": None if compress is None else "gzip",
        }
        if compress is not None:
            self.settings["compression_level"] = compress
        if strategy == "eagle3":
            self.settings["final_norm"] = norm.kind

    def relpath(self, row: int) -> str:
        g = row // SPECFORGE_GROUP * SPECFORGE_GROUP
        return os.path.join(f"rows_{g}-{g + SPECFORGE_GROUP}", f"data_{row}{self.suffix}")

    def build(self, r: Row) -> dict:
        import torch

        ids = r.token_ids.contiguous()
        mask = torch.ones_like(ids) if r.loss_mask is None else r.loss_mask.to(torch.int64)
        hs = r.floats()
        side_by_side = hs[:, self.take].reshape(hs.shape[0], -1).to(self.dtype).unsqueeze(0).contiguous()
        if self.strategy == "dflash":
            # SpecForge refuses such a sample at training time; its own capture leaves it out.
            if not bool((mask[1:].bool() & mask[:-1].bool()).any()):
                raise Skip("no two consecutive supervised tokens (SpecForge's DFlash needs them)")
            return {"input_ids": ids, "loss_mask": mask, "hidden_states": side_by_side}
        last = self.norm(hs[:, self.last], self.dtype).unsqueeze(0).contiguous()
        return {"input_ids": ids, "loss_mask": mask, "aux_hidden_state": side_by_side, "hidden_state": last}

    def serialize(self, tensors: dict, row: int) -> bytes:
        data = _torch_saved(tensors)
        # What SpecForge's gzip.open(path, "wb") around torch.save writes (torch's zip writer
        # never seeks, so the stream holds the .ckpt's bytes), without the timestamp.
        return data if self.compress is None else gzipped(data, f"data_{row}.ckpt", self.compress)


class ModelOptLayout:
    """Model-Optimizer's EAGLE-3 offline dumps: ``{row}.pt`` in ``OUT`` (its
    ``offline_data_path``, which it searches for ``*.pt`` recursively)."""

    name = "modelopt"
    fills_loss_mask = True

    def __init__(
        self,
        out: str,
        layer_ids: list[int],
        stored_dtype: Any,
        *,
        num_layers: int,
        layers: list[int] | None = None,
        dtype: str = "stored",
        norm: Any = None,
        prenorm: bool = False,
    ):
        self.root, self.prenorm = out, prenorm
        self.dtype = _dtype(dtype, stored_dtype, self.name)
        self.norm = None if prenorm else norm
        if not prenorm and norm is None:
            raise InvalidInputError("--to modelopt needs the final norm (--model) unless --prenorm")
        example = f"--layers 2,{num_layers // 2},{num_layers - 3},{num_layers}"
        if num_layers not in layer_ids:
            raise InvalidInputError(
                f"Model-Optimizer's hidden_states is the verifier's last layer: the dataset needs layer "
                f"{num_layers} (N, the last decoder layer's output) but has {layer_ids}: generate with it "
                f"(e.g. {example})"
            )
        aux = [i for i in layer_ids if i != num_layers] if layers is None else layers
        if not aux:
            raise InvalidInputError(
                f"the dataset holds only layer {num_layers} (N): EAGLE-3's aux_hidden_states need auxiliary "
                f"layers, e.g. generate with {example}"
            )
        # Ascending whatever --layers says: Model-Optimizer's capture scripts sort them, and its
        # draft (forward hooks) and the serving engines collect them in layer order.
        self.take = sorted(_pick(layer_ids, aux), key=lambda i: layer_ids[i])
        self.last = layer_ids.index(num_layers)
        self.layer_ids = [layer_ids[i] for i in self.take]
        if 0 in self.layer_ids:
            raise InvalidInputError(
                "vLLM layer 0 (the embeddings) is no decoder layer's output, which Model-Optimizer's aux "
                "layers are: leave it out with --layers"
            )
        if max(self.layer_ids) > num_layers:
            raise InvalidInputError(f"layer ids {self.layer_ids} exceed the model's {num_layers} layers")
        ids, default = modelopt_ids(self.layer_ids), modelopt_default_aux(num_layers)
        config_note = (
            "its default"
            if ids == default
            else f"not its default {default}: set eagle_architecture_config.eagle_aux_hidden_state_layer_ids"
        )
        last = "before the final norm, hidden_states_prenorm" if prenorm else f"after {norm.kind}"
        self.describe = (
            f"{{row}}.pt: input_ids, loss_mask, conversation_id, aux_hidden_states [T, {len(ids)}H] (vLLM "
            f"layers {self.layer_ids} = Model-Optimizer {ids}, {config_note}), hidden_states [T, H] "
            f"(layer {num_layers} {last})"
        )
        self.settings = {
            "format": "modelopt",
            "layer_ids": self.layer_ids,
            "modelopt_layer_ids": ids,
            "last_layer": num_layers,
            "dtype": _dtype_name(self.dtype),
            "final_norm": "left to Model-Optimizer (hidden_states_prenorm)" if prenorm else norm.kind,
        }

    def relpath(self, row: int) -> str:
        return f"{row}.pt"

    def build(self, r: Row) -> dict:
        import torch

        ids = _compact(r.token_ids)
        mask = torch.ones_like(ids) if r.loss_mask is None else r.loss_mask.to(torch.int64)
        hs = r.floats()
        aux = hs[:, self.take].reshape(hs.shape[0], -1).to(self.dtype)
        last = hs[:, self.last].to(self.dtype) if self.norm is None else self.norm(hs[:, self.last], self.dtype)
        tensors = {
            "input_ids": ids,
            "hidden_states": _compact(last),
            "aux_hidden_states": _compact(aux),
            "loss_mask": _compact(mask),
            "conversation_id": str(r.row),
        }
        if self.prenorm:
            tensors["hidden_states_prenorm"] = True
        return tensors

    def serialize(self, tensors: dict, row: int) -> bytes:
        return _torch_saved(tensors)


__all__ = [
    "DTYPES",
    "ModelOptLayout",
    "RecordProblem",
    "Row",
    "SPECFORGE_GROUP",
    "SPECFORGE_GZIP_LEVEL",
    "Skip",
    "SpecForgeLayout",
    "SpeculatorsLayout",
    "check_record",
    "stored_float_dtype",
    "modelopt_default_aux",
    "modelopt_ids",
    "specforge_ids",
]
