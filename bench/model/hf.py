"""A Transformers ``config.json`` as a ``ModelConfig``: Llama, Qwen2, Qwen3 and Mistral decoders.

Every Transformers model ships a ``config.json``; ``--model path/to/config.json`` (and a sweep
spec's ``models:``) reads one with no network and no Transformers import. A mapping is taken for
a Transformers config when it has any of ``TRANSFORMERS_KEYS``; ``ModelConfig.from_file`` sends
it here. The fields read, with the meaning the architectures' configuration classes give them
(``transformers/models/<type>/configuration_<type>.py``):

* ``hidden_size`` -> ``dim``, ``num_hidden_layers`` -> ``n_layers``, ``num_attention_heads`` ->
  ``n_heads``, ``num_key_value_heads`` -> ``n_kv_heads``, ``intermediate_size`` -> ``ffn_dim``,
  ``vocab_size`` -> ``vocab_size``: a file without one is refused, naming it (the classes'
  defaults are no model's shape; ``num_key_value_heads``' even differs between classes);
* ``head_dim`` -> ``head_dim``; absent: ``hidden_size // num_attention_heads``, as the Llama,
  Qwen2 and Mistral classes derive it; a Qwen3 file without it is refused (its class's
  default, 128, is a constant);
* ``rope_theta``, or ``rope_parameters["rope_theta"]`` -> ``rope_theta`` (refused when absent);
* ``rms_norm_eps`` -> ``norm_eps`` (absent: 1e-6, every class's default);
* ``tie_word_embeddings`` -> ``tie_word_embeddings`` (absent: false, every class's default);
* ``model_type`` ``qwen3`` -> ``qk_norm`` (Qwen3's per-head RMSNorm on queries and keys).

``rope_parameters`` is Transformers 5's form (``{"rope_type": ..., "rope_theta": ...}``, or one
such mapping per layer type, of which ``full_attention``'s is read); ``rope_theta`` beside
``rope_scaling`` is the form of the published 4.x files. A RoPE scaling (``llama3``, ``yarn``,
...) changes the rotation frequencies, not a tensor's shape or a FLOP, and is recorded in the
config's note rather than modelled; so are biases the decoder does not carry (Qwen2's q/k/v
biases, ``attention_bias``/``mlp_bias``: one vector per projection).

Refused, in one line naming what is not modelled: mixture-of-experts and linear-attention
layers (before the architecture is looked up, so a Mixtral or Qwen3-MoE config is told it is a
mixture of experts, not that its type is unknown); layers of sliding-window attention actually in
use (Mistral's ``sliding_window``; Qwen2/Qwen3's ``use_sliding_window`` from ``max_window_layers``
on; ``layer_types``); an activation other than SiLU (the decoder's MLP is SwiGLU). An unknown
``model_type`` is named with the supported ones.

The model's name (what a row records as ``model``, part of the trial's identity) is the file's
stem, or, for a file named ``config.json``, its folder's name: ``Qwen3-8B/config.json`` is
``Qwen3-8B``; in a Hugging Face cache (``models--Qwen--Qwen3-8B/snapshots/<commit>/config.json``)
the repository's name, ``Qwen3-8B`` (a name with no ``/``: it also names cache and output files).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

# a mapping with any of these keys is a Transformers config (ours has none of them)
TRANSFORMERS_KEYS = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads")

# mixture-of-experts fields of Transformers' MoE configs (Mixtral, Qwen2/3-MoE, DeepSeek, ...)
MOE_KEYS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size", "num_experts_per_tok")
# fields only linear-attention (hybrid) architectures carry (Qwen3-Next's gated delta net, ...)
LINEAR_KEYS = ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim", "linear_conv_kernel_dim")
FULL = "full_attention"
DEFAULT_NORM_EPS = 1e-6  # rms_norm_eps of LlamaConfig, Qwen2Config, Qwen3Config and MistralConfig


@dataclass(frozen=True)
class Architecture:
    """What one ``model_type`` means for the decoder (from its Transformers configuration class)."""

    qk_norm: bool  # per-head RMSNorm on queries and keys before RoPE
    head_dim_required: bool  # the class's head_dim default is a constant, not hidden_size // heads
    sliding: str  # how sliding-window layers are switched on: "none" | "mistral" | "qwen"
    qkv_bias: bool  # q/k/v projections always carry a bias (not modelled; noted)


ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(qk_norm=False, head_dim_required=False, sliding="none", qkv_bias=False),
    "mistral": Architecture(qk_norm=False, head_dim_required=False, sliding="mistral", qkv_bias=False),
    "qwen2": Architecture(qk_norm=False, head_dim_required=False, sliding="qwen", qkv_bias=True),
    "qwen3": Architecture(qk_norm=True, head_dim_required=True, sliding="qwen", qkv_bias=False),
}


def is_transformers_config(data: Any) -> bool:
    return isinstance(data, dict) and any(key in data for key in TRANSFORMERS_KEYS)


def model_name(path: Path) -> str:
    """The name a Transformers config file gives its model (module docstring)."""
    path = Path(path).resolve() if not Path(path).is_absolute() else Path(path)
    if path.stem != "config":
        return path.stem
    folder = path.parent
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.rsplit("--", 1)[-1]
    return folder.name or path.stem


def _layer_types(data: dict[str, Any], arch: Architecture, n_layers: int) -> list[str]:
    """Each layer's attention type as the architecture's configuration class derives it."""
    given = data.get("layer_types")
    if given is not None:
        return list(given)
    if arch.sliding == "mistral":
        # MistralConfig: sliding_window defaults to 4096, and every layer uses it when set
        window = data.get("sliding_window", 4096)
        return ["sliding_attention" if window is not None else FULL] * n_layers
    if arch.sliding == "qwen":
        # Qwen2Config/Qwen3Config.__post_init__: layers from max_window_layers on slide when use_sliding_window
        if not data.get("use_sliding_window", False) or data.get("sliding_window", 4096) is None:
            return [FULL] * n_layers
        first = data.get("max_window_layers", 28)
        return ["sliding_attention" if i >= first else FULL for i in range(n_layers)]
    return [FULL] * n_layers


def _unmodelled(data: dict[str, Any], source: str) -> None:
    """Refuse mixture-of-experts and linear-attention layers, in one line."""
    moe = {k: data[k] for k in MOE_KEYS if data.get(k) not in (None, 0, False)}
    if moe:
        raise ValueError(f"{source}: mixture-of-experts layers ({', '.join(f'{k}={v}' for k, v in moe.items())}) "
                         f"are not modelled; the suite models dense decoders (Llama, Qwen2, Qwen3, Mistral)")
    linear = [k for k in LINEAR_KEYS if k in data]
    types = data.get("layer_types") or []
    if linear or "linear_attention" in types:
        what = f"layer_types {sorted(set(types) - {FULL})}" if types else ", ".join(linear)
        raise ValueError(f"{source}: linear-attention layers ({what}) are not modelled; the suite models "
                         f"softmax attention over the whole sequence in every layer")


def _required(data: dict[str, Any], name: str, source: str) -> Any:
    if name not in data or data[name] is None:
        raise ValueError(f"{source}: missing field {name!r}, which the decoder's shape needs")
    return data[name]


def _rope(data: dict[str, Any], source: str) -> tuple[float, str | None]:
    """``(rope_theta, rope_type or None)`` from ``rope_parameters`` (Transformers 5) or
    ``rope_theta``/``rope_scaling`` (4.x)."""
    params = data.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and isinstance(params.get(FULL), dict):
        params = params[FULL]  # one set per layer type
    if isinstance(params, dict) and params.get("rope_theta") is not None:
        kind = params.get("rope_type", "default")
        return params["rope_theta"], None if kind == "default" else kind
    if data.get("rope_theta") is None:
        raise ValueError(f"{source}: missing field 'rope_theta' (or 'rope_parameters' with 'rope_theta'), "
                         f"which RoPE needs")
    scaling = data.get("rope_scaling")
    kind = (scaling.get("rope_type") or scaling.get("type")) if isinstance(scaling, dict) else None
    return data["rope_theta"], None if kind in (None, "default") else kind


def _real(value: Any) -> Any:
    """A JSON number as a float (``1000000`` and ``1e6`` are one theta); anything else as is, for
    ``ModelConfig`` to refuse by name."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else value


def fields(data: dict[str, Any], source: str) -> dict[str, Any]:
    """The ``ModelConfig`` fields of a Transformers config (``ValueError``: one line, named)."""
    _unmodelled(data, source)
    kind = data.get("model_type")
    if kind is None:
        raise ValueError(f"{source}: missing field 'model_type' (a Transformers config names its architecture; "
                         f"supported: {sorted(ARCHITECTURES)})")
    arch = ARCHITECTURES.get(kind)
    if arch is None:
        raise ValueError(f"{source}: model_type {kind!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    dim = _required(data, "hidden_size", source)
    heads = _required(data, "num_attention_heads", source)
    n_layers = _required(data, "num_hidden_layers", source)
    sliding = [i for i, t in enumerate(_layer_types(data, arch, n_layers if isinstance(n_layers, int) else 0))
               if t != FULL]
    if sliding:
        raise ValueError(f"{source}: sliding-window attention in {len(sliding)} of {n_layers} layers "
                         f"(sliding_window={data.get('sliding_window', 4096)}) is not modelled; the suite models "
                         f"full causal attention in every layer")
    act = data.get("hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"{source}: hidden_act {act!r} is not modelled; the decoder's MLP is SwiGLU (silu)")
    if arch.head_dim_required:
        head_dim = _required(data, "head_dim", source)
    elif data.get("head_dim") is not None:
        head_dim = data["head_dim"]
    else:
        if not isinstance(dim, int) or not isinstance(heads, int) or heads <= 0 or dim % heads:
            raise ValueError(f"{source}: missing field 'head_dim', and hidden_size={dim!r} is not a multiple of "
                             f"num_attention_heads={heads!r}")
        head_dim = dim // heads
    theta, rope_type = _rope(data, source)
    notes = [f"from a Transformers config (model_type {kind})"]
    if rope_type:
        notes.append(f"RoPE scaling {rope_type!r} not modelled (frequencies only; shapes and FLOPs unchanged)")
    biases = (["q/k/v"] if arch.qkv_bias or data.get("attention_bias") else []) + \
             (["mlp"] if data.get("mlp_bias") else [])
    if biases:
        notes.append(f"{' and '.join(biases)} projection biases not modelled (one vector each)")
    return dict(
        dim=dim, n_layers=n_layers, n_heads=heads, n_kv_heads=_required(data, "num_key_value_heads", source),
        head_dim=head_dim, ffn_dim=_required(data, "intermediate_size", source),
        vocab_size=_required(data, "vocab_size", source), rope_theta=_real(theta), qk_norm=arch.qk_norm,
        norm_eps=_real(data.get("rms_norm_eps", DEFAULT_NORM_EPS)),
        tie_word_embeddings=data.get("tie_word_embeddings", False), note="; ".join(notes),
    )
