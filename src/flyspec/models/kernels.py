"""Faster CPU kernels for a loaded model pair: oneDNN-packed float32 Linear layers and
weight quantisation. :func:`flyspec.models.pair.load_pair` applies them as its
:class:`~flyspec.config.KernelConfig` says; what they gain is measured by
``flyspec bench --forward-cost`` (docs/benchmarks.md).
"""

from __future__ import annotations

import warnings
from dataclasses import replace

import torch

from flyspec.config import KernelConfig
from flyspec.errors import FlyspecError
from flyspec.models.pages import file_backed, file_mappings, release_file_pages


def onednn_linear_available() -> bool:
    """True where torch has the oneDNN ops that run a Linear layer on pre-packed weights."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
    )


class OneDnnLinear(torch.nn.Module):
    """A float32 Linear layer whose weight oneDNN has re-laid out for its kernels."""

    def __init__(self, linear: torch.nn.Linear, batch_hint: int) -> None:
        super().__init__()
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach().contiguous()
        self.register_buffer(
            "packed_weight", torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        )
        bias = None if linear.bias is None else linear.bias.detach().contiguous()
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(
            rows, self.packed_weight, self.bias, "none", [], ""
        )
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"


def pack_linear_layers(model, *, batch_hint: int = 16) -> int:
    """Run every float32 ``nn.Linear`` of a CPU model on oneDNN with pre-packed weights.

    The result is still float32 arithmetic (logits within ~1e-4 of the default kernels), but
    on this project's 2-core AVX2 machine the 1.5B target's forward costs 174 ms instead of
    311 ms for 1 new token and 396 ms instead of 899 ms for 16 (one thread, CPU time): small
    matrix products are where MKL's default path is weakest. Returns the number of layers
    replaced (0 where oneDNN is missing or the model is not float32 on the CPU). Each weight
    is re-laid out and its original let go at once: freed where nothing else holds it (a tied
    output layer keeps its embedding), and where it is a page of the checkpoint's file mapping
    (transformers maps safetensors), that page leaves the process's resident memory. So the
    model is held once, not as its file plus its packed copy: call it once after loading.
    """
    if not onednn_linear_available():
        return 0
    # Names only: a reference to a replaced layer would keep its weight alive beside the
    # packed copy until the last layer is packed.
    places = [
        (parent_name, name)
        for parent_name, parent in model.named_modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
        and child.weight.dtype == torch.float32
        and child.weight.device.type == "cpu"
    ]
    mappings = file_mappings()
    for parent_name, name in places:
        parent = model.get_submodule(parent_name)
        original = getattr(parent, name)
        mapped = file_backed([original.weight], mappings)
        setattr(parent, name, OneDnnLinear(original, batch_hint))
        # While ``original`` still holds the mapping: once its last view is gone, the range
        # may be unmapped and reused by other memory, which madvise would then wipe.
        release_file_pages(mapped)
        del original
    return len(places)


def quantize_fp16(model):
    """float16 weights for every ``nn.Linear`` (fbgemm's packed fp16 GEMM, float32 activations
    and accumulation), in place; returns the model.

    Unlike int8 it quantises no activation, so a 16-token forward gives the logits of 16
    one-token forwards (to ~5e-5, as float32 does): safe for the target. The weights are
    rounded to float16, so the model's greedy output may differ from the float32 model's in
    rare near-ties. Measured here on the 1.5B target (2 threads): 63 ms for 1 new token and
    172 ms for 16, against 146 / 207 ms with float32 weights on oneDNN.
    """
    return quantize_linear_layers(model, torch.float16)


def quantize_linear_layers(model, dtype: torch.dtype):
    """``quantize_dynamic`` of every ``nn.Linear`` to ``dtype``, in place, one decoder layer at
    a time (then the rest, such as the output layer), each part's float weights let go before
    the next (their pages of the checkpoint's file mapping too: :func:`pack_linear_layers`
    says why), so that the model is never held twice; returns the model."""
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    mappings = file_mappings()
    for part in [*layers, model]:
        weights = [m.weight for m in part.modules() if type(m) is torch.nn.Linear]
        replaced = file_backed(weights, mappings)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao.quantization announces its move to torchao
            torch.ao.quantization.quantize_dynamic(
                part, {torch.nn.Linear}, dtype=dtype, inplace=True
            )
        release_file_pages(replaced)  # while ``weights`` still hold the mapping
        del weights
    return model


_GATED_MLP_TYPES = frozenset({"LlamaMLP", "Qwen2MLP", "MistralMLP"})


def merged_int8_linear(linears: list[torch.nn.Linear]) -> torch.nn.Module:
    """One dynamic int8 Linear layer whose output is the outputs of the float ``linears``
    (same input size) side by side, ``[..., sum of out_features]``, with the bits each of them
    would have after :func:`quantize_int8` on its own.

    Each weight is quantised with its own scale, as ``quantize_dynamic`` does it (one scale
    per tensor); the merged layer holds those scales per output row. The activation is
    quantised once per call, as each layer would quantise the same input, so only the number
    of calls changes.
    """
    from torch.ao.quantization import default_dynamic_qconfig

    values, scales, zero_points, biases = [], [], [], []
    for linear in linears:
        observer = default_dynamic_qconfig.weight()
        weight = linear.weight.detach().float()
        observer(weight)
        scale, zero_point = observer.calculate_qparams()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # quantized tensor creation announces deprecation
            quantized = torch.quantize_per_tensor(
                weight, float(scale), int(zero_point), torch.qint8
            )
        values.append(quantized.int_repr())
        rows = weight.shape[0]
        scales.append(torch.full((rows,), float(scale), dtype=torch.double))
        zero_points.append(torch.full((rows,), int(zero_point), dtype=torch.long))
        biases.append(torch.zeros(rows) if linear.bias is None else linear.bias.detach().float())
    values = torch.cat(values)
    has_bias = any(linear.bias is not None for linear in linears)
    merged = torch.ao.nn.quantized.dynamic.Linear(
        values.shape[1], values.shape[0], bias_=has_bias, dtype=torch.qint8
    )
    merged.set_weight_bias(
        torch._make_per_channel_quantized_tensor(
            values, torch.cat(scales), torch.cat(zero_points), 0
        ),
        torch.cat(biases) if has_bias else None,
    )
    return merged


class GatedMLP(torch.nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up computed by one Linear layer whose
    output is ``[gate | up]``: the Llama-family MLP in two matrix products instead of three."""

    def __init__(self, gate_up_proj: torch.nn.Module, down_proj: torch.nn.Module, act_fn) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_proj
        self.down_proj = down_proj
        self.act_fn = act_fn

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act_fn(gate) * up)


def merge_int8_projections(model: torch.nn.Module) -> int:
    """Give each Llama-family decoder layer merged int8 projections for the float Linear
    layers that read the same input (:func:`merged_int8_linear`), in place; return the number
    of layers changed.

    The MLP's gate and up become one layer (:class:`GatedMLP` replaces the MLP, so
    ``model(...)`` uses it too); q, k and v get a merged copy, ``self_attn.merged_qkv_proj``,
    which :class:`~flyspec.models.lean.LeanForward` calls instead of the three (transformers'
    attention keeps calling the originals, quantised afterwards with the same bits).
    """
    layers = getattr(getattr(model, "model", None), "layers", None) or []
    changed = 0
    mappings = file_mappings()
    for layer in layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        projections = [getattr(attention, name, None) for name in ("q_proj", "k_proj", "v_proj")]
        merged_here = False
        if all(type(p) is torch.nn.Linear for p in projections):
            attention.merged_qkv_proj = merged_int8_linear(projections)
            merged_here = True
        parts = [getattr(mlp, name, None) for name in ("gate_proj", "up_proj")]
        if type(mlp).__name__ in _GATED_MLP_TYPES and all(
            type(p) is torch.nn.Linear for p in parts
        ):
            layer.mlp = GatedMLP(merged_int8_linear(parts), mlp.down_proj, mlp.act_fn)
            # gate and up leave the model here: nothing else lets their file pages go.
            release_file_pages(file_backed([p.weight for p in parts], mappings))
            merged_here = True
        changed += merged_here
    return changed


def quantize_int8(model):
    """Dynamic int8 quantisation of every ``nn.Linear`` (int8 weights with one scale per
    tensor, activations quantised per call), in place; returns the model.

    Layers that read the same input are merged first (:func:`merge_int8_projections`, the
    same bits in fewer calls: each int8 call has a fixed cost of tens of microseconds here).
    Use it for the *draft*: the activation scale is computed over all tokens of a call, so a
    16-token forward does not give the logits of 16 one-token forwards (measured: 2 greedy
    tokens of 64 flip on the 1.5B target), and an int8 target would break exact SPD's equality
    with the target's own output. A draft's numbers never change what SPD emits, only how much
    of the draft is accepted.
    """
    merge_int8_projections(model)
    return quantize_linear_layers(model, torch.qint8)


def check_target_quant(target_quant: str, dtype: torch.dtype) -> None:
    """FlyspecError where ``target_quant`` would quantise a target that is not float32."""
    if target_quant != "none" and dtype != torch.float32:
        name = str(dtype).removeprefix("torch.")
        raise FlyspecError(
            f"target_quant={target_quant} quantises float32 weights, but the target's dtype is "
            f"{name}: choose one (--dtype float32, or --target-quant none)"
        )


def check_compiled_forward(kernels: KernelConfig) -> None:
    """FlyspecError where the compiled forward would meet the CPU kernels, which
    ``torch.compile`` cannot lower: it compiles torch's own layers."""
    plain = KernelConfig.plain()
    if kernels.forward == "compiled" and replace(kernels, forward=plain.forward) != plain:
        raise FlyspecError(
            "the compiled forward compiles torch's own layers, not the CPU kernels: add "
            "--linear default --draft-quant none --target-quant none, or use --forward lean"
        )


def apply_cpu_kernels(
    *, target: torch.nn.Module, draft: torch.nn.Module | None, kernels: KernelConfig
) -> dict:
    """Switch a loaded pair's torch modules to the CPU kernels of ``kernels``, in place, before
    they are wrapped for decoding; return what was done (the CPU part of
    :attr:`~flyspec.models.pair.LoadedPair.kernels`).

    Quantisation comes first; the float32 Linear layers left are then packed for oneDNN. A
    quantised draft is made from float32 weights whatever the target's dtype; a quantised
    target needs float32 weights (FlyspecError otherwise). Models on other devices are left
    as they are. Every replaced layer keeps ``out_features``, from which the logits' rows are
    read (:func:`~flyspec.models.lean.output_rows`).
    """
    linear, draft_quant, target_quant = kernels.linear, kernels.draft_quant, kernels.target_quant
    done = {"linear": linear, "draft_quant": draft_quant, "target_quant": target_quant}
    roles = {"draft": (draft, draft_quant), "target": (target, target_quant)}
    for role, (model, quant) in roles.items():
        if model is None or next(model.parameters()).device.type != "cpu":
            done[f"{role}_packed_layers"] = 0
            continue
        dtype = next(model.parameters()).dtype
        if role == "target":
            check_target_quant(quant, dtype)
        elif quant != "none" and dtype != torch.float32:
            # The draft's numbers never change what exact SPD emits: it is quantised from
            # float32 whatever the target's dtype (token ids are all the two models share).
            model.float()
        if quant == "int8":
            quantize_int8(model)
        elif quant == "fp16":
            quantize_fp16(model)
        done[f"{role}_packed_layers"] = pack_linear_layers(model) if linear == "onednn" else 0
    return done
