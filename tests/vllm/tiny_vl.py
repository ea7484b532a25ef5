"""A tiny random Qwen2.5-VL (vision-language) model and its processor, built on the spot with
transformers, for the vLLM tests of a prompt with an image (issue 25, docs/CONNECTOR.md).

The language model is a 4-layer Qwen2 (hidden 128, head size 64, which vLLM's CPU attention
supports) with multimodal rotary positions; the vision tower is a 2-block Qwen2.5-VL encoder
whose merger projects every 2x2 patch group to one language-model token. The tokenizer is the
word-level one of ``tiny_llama`` plus Qwen's vision tokens, added as special tokens so that
they split without spaces; the image processor is transformers' PIL one (no torchvision).
Nothing is downloaded, and the same ``seed`` builds the same weights.
"""

from __future__ import annotations

import os
from pathlib import Path

from tiny_llama import save_random_model, write_tokenizer

#: Qwen2-VL's vision tokens: an image is ``<|vision_start|>`` + one ``<|image_pad|>`` per merged
#: patch group + ``<|vision_end|>`` in the prompt; the processor expands one ``<|image_pad|>``.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
IMAGE_PAD = "<|image_pad|>"
PATCH = 14
MERGE = 2
#: The image sizes the processor keeps (it resizes to multiples of PATCH * MERGE = 28 within
#: these pixel counts): a 56 x 84 image is 4 x 6 patches, 2 x 3 = 6 image tokens.
MIN_PIXELS = 28 * 28
MAX_PIXELS = 112 * 112


def _vision_tokenizer(out: Path) -> tuple[dict[str, int], int, dict[str, int]]:
    """Writes the tiny tokenizer with the vision tokens added into ``out``: its base vocabulary,
    its size with them, and their ids."""
    from transformers import AutoTokenizer

    vocab = write_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    tokenizer.save_pretrained(out)
    return vocab, len(tokenizer), {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}


def build_tiny_qwen2_5_vl(path: str | os.PathLike, *, dtype: str = "float32", seed: int = 0) -> str:
    """Writes a random ``Qwen2_5_VLForConditionalGeneration``, its tokenizer and its processor
    into ``path`` and returns the path."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(path)
    vocab, vocab_size, ids = _vision_tokenizer(out)
    hidden = 128
    config = Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [8, 12, 12]},
            bos_token_id=vocab["<s>"],
            eos_token_id=vocab["</s>"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            window_size=56,
            fullatt_block_indexes=[1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    # The top-level config keeps no token ids of its own in transformers 5; the generation
    # config that save_random_model writes reads them from it.
    config.bos_token_id, config.eos_token_id = vocab["<s>"], vocab["</s>"]
    save_random_model(Qwen2_5_VLForConditionalGeneration, config, out, dtype=dtype, seed=seed)
    image_processor = Qwen2VLImageProcessorPil(
        patch_size=PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": MIN_PIXELS, "longest_edge": MAX_PIXELS},
    )
    # Saved alone: Qwen2_5_VLProcessor itself cannot be built here, as it needs a video processor
    # and every video processor of transformers needs torchvision (docs/CONNECTOR.md). Its
    # from_pretrained reads this file and the tokenizer's.
    image_processor.save_pretrained(out)
    return str(out)


#: Qwen3-VL's vision patches are 16 pixels (merged 2 x 2 as Qwen2-VL's): a 64 x 96 image is
#: 4 x 6 patches, 2 x 3 = 6 image tokens.
QWEN3_PATCH = 16


def build_tiny_qwen3_vl(path: str | os.PathLike, *, dtype: str = "float32", seed: int = 0) -> str:
    """Writes a random ``Qwen3VLForConditionalGeneration``, its tokenizer and its image processor
    into ``path`` and returns the path. The language model is a 4-layer Qwen3 (hidden 128, head
    size 64) with interleaved multimodal rotary positions; the vision tower has 3 blocks, and the
    outputs of its first two ("deepstack") are added to the image rows after the language
    model's layers 0 and 1, as Qwen3-VL does after its first three."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    out = Path(path)
    vocab, vocab_size, ids = _vision_tokenizer(out)
    hidden = 128
    config = Qwen3VLConfig(
        text_config=dict(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=64,
            max_position_embeddings=4096,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 10000.0,
                "mrope_section": [16, 8, 8],
                "mrope_interleaved": True,
            },
            bos_token_id=vocab["<s>"],
            eos_token_id=vocab["</s>"],
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=3,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=hidden,
            patch_size=QWEN3_PATCH,
            spatial_merge_size=MERGE,
            temporal_patch_size=2,
            num_position_embeddings=64,
            deepstack_visual_indexes=[0, 1],
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    config.bos_token_id, config.eos_token_id = vocab["<s>"], vocab["</s>"]
    save_random_model(Qwen3VLForConditionalGeneration, config, out, dtype=dtype, seed=seed)
    side = QWEN3_PATCH * MERGE
    Qwen2VLImageProcessorPil(
        patch_size=QWEN3_PATCH,
        merge_size=MERGE,
        temporal_patch_size=2,
        size={"shortest_edge": side * side, "longest_edge": 4 * side * 4 * side},
    ).save_pretrained(out)
    return str(out)


def image_prompt(words_before: str, words_after: str) -> str:
    """A prompt with one image between two runs of words, as Qwen2-VL's chat template places it
    (``<|vision_start|><|image_pad|><|vision_end|>``), which vLLM expands to the image's tokens."""
    return f"{words_before} <|vision_start|><|image_pad|><|vision_end|> {words_after}"


def expand_image_tokens(token_ids: list[int], image_grid_thw, pad_id: int) -> list[int]:
    """``token_ids`` with each image's one ``<|image_pad|>`` (``pad_id``) repeated as Qwen2-VL's
    processor (and vLLM's prompt update) repeats it: grid_t * grid_h * grid_w / MERGE**2 times,
    the image's patch groups. ``image_grid_thw``: ``[images, 3]`` (the image processor's)."""
    counts = [int(t * h * w) // MERGE**2 for t, h, w in image_grid_thw.tolist()]
    out: list[int] = []
    for tok in token_ids:
        if tok != pad_id:
            out.append(tok)
        elif not counts:
            raise ValueError(f"more {IMAGE_PAD} tokens in the prompt than images")
        else:
            out.extend([pad_id] * counts.pop(0))
    if counts:
        raise ValueError(f"{len(counts)} image(s) more than {IMAGE_PAD} tokens in the prompt")
    return out


def random_image(width: int = 84, height: int = 56, seed: int = 0):
    """A random RGB ``PIL.Image`` of ``width`` x ``height`` (multiples of 28 keep it unresized)."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


__all__ = [
    "IMAGE_PAD",
    "VISION_TOKENS",
    "build_tiny_qwen2_5_vl",
    "build_tiny_qwen3_vl",
    "expand_image_tokens",
    "image_prompt",
    "random_image",
]
