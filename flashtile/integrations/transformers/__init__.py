"""Hugging Face transformers: ``attn_implementation="flashtile"``.

Modules: ``masks`` (the mask interface: the form each layer's mask takes), ``attention``
(the attention function and the generate_batch adapter), this one (registration).

    import flashtile.integrations.transformers   # registers "flashtile" (idempotent)

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashtile")
    model.set_attn_implementation("flashtile")   # or switch a loaded model

Importing this package calls ``register()``, which registers under the name "flashtile":

- in ``AttentionInterface`` (transformers >= 4.51), ``attention_forward``: every attention
  layer calls it with query (b, h, sq, d), key/value (b, hkv, sk, d), the layer's mask
  and options (scaling, sliding_window, softcap, dropout, is_causal); it returns
  (b, sq, h, d) from flashtile's kernels, with GQA read in place (no repeated K/V).
- in ``AttentionMaskInterface`` (transformers >= 4.53), ``build_mask``: transformers'
  masking_utils calls it once per forward and layer type, and it returns the mask in the
  form ``attention_forward`` reads, never a (b, sq, sk) tensor for the usual patterns:
    * None: no padding, the keys are the tokens so far (dense kernels; causal aligned
      at the bottom-right corner, so a decode step over a cache needs no mask);
    * 2-D bool (b, n), True = a real token: padding, in flash-attn's convention in
      transformers (column n - 1 is the last query's position; a static cache's slots
      past column n are not filled yet). Prefill and training unpad it to
      ``flash_attn_varlen_func``; a decode step whose padding is all at the left
      (``generate``'s batches; build_mask finds it in the same host read as "all
      ones", once per forward, and marks the mask) runs the split-KV decode kernel
      with it as ``cache_leftpad``; any other decode step reads it as a (b, 1, 1, n)
      mask in the kernel, which costs less than gathering the whole cache every step,
      and so does any step under torch.compile (unpadding has data-dependent sizes;
      no host read there);
    * 1-D int32 (count + 1,): ``cu_seqlens`` of sequences packed along the flattened
      batch (position_ids that restart), served by ``flash_attn_varlen_func``;
    * 4-D: a pattern flashtile cannot describe (a model's own overlay such as image-token
      blocks, chunked attention), materialised by transformers' ``sdpa_mask`` and read
      tile by tile (logged once). transformers 4.51-4.52 have no mask interface: their
      models build 4-D masks for any implementation but their own, and those are read
      the same way.
- for transformers >= 5, which counts every name containing "flash" as a flash-attn
  build (``is_flash_attention_requested``) and so looks "flashtile" up as a Hub kernel
  when a model is loaded: the answer to that lookup is the flashtile package itself,
  which has flash-attn's ``flash_attn_func``, ``flash_attn_varlen_func`` and
  ``flash_attn_with_kvcache`` as a Hub kernel module does (``_serve_flash_lookup``).

Supported: training (gradients) and inference; ``generate`` with the dynamic and the
static cache (transformers >= 5 keeps the 2-D mask with a static cache for "flash"
names, so the unfilled slots are never read), under torch.compile too; GQA/MQA;
causal and bidirectional layers (``module.is_causal``, or the ``is_causal`` a model
passes); sliding windows (``sliding_window``: window_size (w - 1, 0) when causal,
(w - 1, w - 1) when not, flash-attn's convention in transformers); Gemma 2's softcap;
the module's ``scaling``; a value head_dim smaller than the query's (MLA: zero-padded,
as transformers' flash-attn path does); ``generate_batch`` (continuous batching, 5.x):
its packed batches, through ``flash_attn_varlen_func`` (its paged decode fast path is
not open to this name: see ``paged_attention_forward``); attention dropout in training
mode (the ``dropout`` models pass, as flashtile's dropout_p on every path: flashtile's
own Philox mask from PyTorch's generator, so training is reproducible under
torch.manual_seed but draws other masks than sdpa or eager). Not supported, with an
error naming the argument: attention sinks (``s_aux``), T5-style ``position_bias``,
``head_mask``.

No import-free route exists: transformers 4.51-5.x looks attention implementations up
in its registries only (no entry points), and a Hub-kernel name ("namespace/name")
needs the ``kernels`` package and a published kernel repository. Importing this module
(or calling ``register()``) once per process is the way.
"""

from __future__ import annotations

import functools

from packaging import version

import flashtile
from flashtile.integrations.transformers._notes import NAME
from flashtile.integrations.transformers.attention import (attention_forward,
                                                            paged_attention_forward)
from flashtile.integrations.transformers.masks import build_mask

MIN_VERSION = "4.51"  # the first release with transformers.AttentionInterface
__all__ = ["register", "attention_forward", "build_mask", "paged_attention_forward", "NAME"]


def _import_transformers():
    try:
        import transformers
    except ModuleNotFoundError as e:
        if e.name != "transformers":
            raise  # transformers is there but one of its own imports failed
        raise ImportError("flashtile.integrations.transformers needs Hugging Face "
                          "transformers: pip install 'flashtile[hf]'") from e
    if version.parse(transformers.__version__) < version.parse(MIN_VERSION):
        raise ImportError(
            f"flashtile.integrations.transformers: expected transformers >= {MIN_VERSION} "
            f"(the first release with AttentionInterface), got {transformers.__version__}."
            " Upgrade it: pip install -U transformers")
    return transformers


def register() -> str:
    """Register ``attn_implementation="flashtile"`` with transformers (idempotent) and
    return the name. Raises ImportError for a transformers older than 4.51."""
    transformers = _import_transformers()
    transformers.AttentionInterface.register(NAME, attention_forward)
    if "paged|flash_attention_2" in transformers.AttentionInterface._global_mapping:
        # 5.0-5.2x: generate_batch switches a model to "paged|<its implementation>".
        transformers.AttentionInterface.register(f"paged|{NAME}", paged_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:
        pass  # 4.51-4.52: the models build 4-D masks, which attention_forward reads
    else:
        AttentionMaskInterface.register(NAME, build_mask)
    _serve_flash_lookup()
    return NAME


def _serve_flash_lookup():
    """transformers >= 5 takes "flashtile" for a flash-attn build (the name contains
    "flash"): loading a model then calls ``lazy_import_flash_attention("flashtile")``,
    which asks ``hub_kernels.load_and_register_attn_kernel`` for a kernel module by that
    name and raises when it gets none. Answer with the flashtile package, whose three
    functions have flash-attn's signatures; every other name goes to transformers."""
    try:
        from transformers.integrations import hub_kernels
        from transformers.utils.generic import is_flash_attention_requested
    except ImportError:
        return  # transformers 4.x: only "flash_attention_*" names are flash-attn builds
    if not is_flash_attention_requested(requested_attention_implementation=NAME):
        return
    original = hub_kernels.load_and_register_attn_kernel
    if getattr(original, "_serves_flashtile", False):
        return

    @functools.wraps(original)
    def load_and_register_attn_kernel(attn_implementation, *args, **kwargs):
        if attn_implementation.removeprefix("paged|") == NAME:
            return flashtile
        return original(attn_implementation, *args, **kwargs)

    load_and_register_attn_kernel._serves_flashtile = True
    hub_kernels.load_and_register_attn_kernel = load_and_register_attn_kernel


register()
