"""A tiny random Llama and a local tokenizer, built on the spot with transformers.

The demo and the vLLM tests need a model that vLLM can serve without downloading anything. This
builds one in a few hundred milliseconds: random weights (seeded, so every build is identical),
a word-level tokenizer over a fixed English vocabulary, saved with ``save_pretrained`` so that
both vLLM and transformers load it from the directory.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

#: Words of the tokenizer's vocabulary (ids 3.. in this order; 0-2 are special tokens).
WORDS: tuple[str, ...] = tuple(
    """
    the of and to a in is it you that he was for on are with as I his they be at one have this
    from or had by hot word but what some we can out other were all there when up use your how
    said an each she which do their time if will way about many then them write would like so
    these her long make thing see him two has look more day could go come did number sound no
    most people my over know water than call first who may down side been now find any new work
    part take get place made live where after back little only round man year came show every
    good me give our under name very through just form sentence great think say help low line
    differ turn cause much mean before move right boy old too same tell does set three want air
    well also play small end put home read hand port large spell add even land here must big high
    such follow act why ask men change went light kind off need house picture try us again animal
    point mother world near build self earth father head stand own page should country found
    answer school grow study still learn plant cover food sun four between state keep eye never
    last let thought city tree cross farm hard start might story saw far sea draw left late run
    while press close night real life few north open seem together next white children begin got
    walk example ease paper group always music those both mark often letter until mile river car
    feet care second book carry took science eat room friend began idea fish mountain stop once
    base hear horse cut sure watch color face wood main enough plain girl usual young ready above
    ever red list though feel talk bird soon body dog family direct pose leave song measure door
    product black short numeral class wind question happen complete ship area half rock order fire
    south problem piece told knew pass since top whole king space heard best hour better true
    during hundred five remember step early hold west ground interest reach fast verb sing listen
    six table travel less morning ten simple several vowel toward war lay against pattern slow
    center love person money serve appear road map rain rule govern pull cold notice voice unit
    power town fine certain fly fall lead cry dark machine note wait plan figure star box noun
    field rest correct able pound done beauty drive stood contain front teach week final gave
    green oh quick develop ocean warm free minute strong special mind behind clear tail produce
    fact street inch multiply nothing course stay wheel full force blue object decide surface deep
    moon island foot system busy test record boat common gold possible plane stead dry wonder laugh
    thousand ago ran check game shape equate miss brought heat snow tire bring yes distant fill
    east paint language among
    """.split()
)
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
#: Role markers of the chat template, after the words (so the words keep their ids).
CHAT_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
#: A minimal chat template: each message as ``<|role|> words <|end|>``, and ``<|assistant|>``
#: when a generation prompt is asked for. Whitespace separates the tokens, as the tokenizer splits.
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
#: The same rendering, with the assistant's turns marked by ``{% generation %}`` for transformers'
#: ``return_assistant_tokens_mask`` (and ``layertap generate --loss-mask``). Each marked span ends
#: on a token: transformers maps its last character to a token, and a space maps to none.
CHAT_TEMPLATE_WITH_GENERATION = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|assistant|> {% generation %}{{ m['content'] }} <|end|>{% endgeneration %} "
    "{% else %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)


def build_tiny_llama(
    path: str | os.PathLike,
    *,
    num_layers: int = 4,
    hidden_size: int = 128,
    num_heads: int = 2,
    num_kv_heads: int = 1,
    intermediate_size: int = 256,
    max_position_embeddings: int = 4096,
    dtype: str = "float32",
    seed: int = 0,
) -> str:
    """Writes a random ``LlamaForCausalLM`` and its tokenizer into ``path`` and returns the path.

    The default shape (head size 64) is one vLLM's CPU attention kernels support.

    Nothing is downloaded. The weights are drawn with ``seed`` in float32, so two builds with
    the same arguments are identical, and a build in another ``dtype`` holds the same weights
    rounded. Save the model in the dtype it will run in: vLLM warns about every cast. The
    tokenizer has a chat template (``CHAT_TEMPLATE``).
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(path)
    vocab = write_tokenizer(out)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        tie_word_embeddings=False,
    )
    return save_random_model(LlamaForCausalLM, config, out, dtype=dtype, seed=seed)


def write_tokenizer(out: Path) -> dict[str, int]:
    """Writes the word-level tokenizer, with its chat template, into ``out`` (created if
    missing); returns its vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS + WORDS + CHAT_TOKENS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out)
    return vocab


def save_random_model(model_class, config, out: Path, *, dtype: str = "float32", seed: int = 0) -> str:
    """Draws ``model_class(config)``'s weights with ``seed``, saves the model into ``out`` (beside
    the tokenizer) and returns the path."""
    import torch

    torch.manual_seed(seed)
    model = model_class(config)
    # The default init (std 0.02) shrinks activations to nearly nothing; unit-variance embeddings
    # and 1/sqrt(fan_in) weights keep every layer's hidden states of order one and distinct.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("embed_tokens.weight", "wte.weight")):
                p.normal_(0.0, 1.0)
            elif p.dim() >= 2:  # [out, in], or [experts, out, in] for fused experts
                p.normal_(0.0, p.shape[-1] ** -0.5)
    model.to(getattr(torch, dtype)).save_pretrained(out)
    # vLLM reads the generation defaults; keep sampling deterministic unless asked otherwise.
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id})
    )
    return str(out)


def prompt(n_words: int, offset: int = 0) -> str:
    """A prompt of ``n_words`` vocabulary words (one token each), starting at word ``offset``."""
    return " ".join(WORDS[(offset + i * 7) % len(WORDS)] for i in range(n_words))
