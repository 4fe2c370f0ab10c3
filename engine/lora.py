"""LoRA adapters on the engine's base model: PEFT folders read and checked once at registration (`load_adapter`), and
the device's adapter slots (`LoRASlotWeights`) that add each row's low-rank term after the base projections.

A PEFT LoRA adapter is a folder with `adapter_config.json` (r, lora_alpha, target_modules, use_rslora) and
`adapter_model.safetensors` (per targeted projection `lora_A.weight` [r, in] and `lora_B.weight` [out, r]).
PEFT computes `base(x) + B(A(x)) * scale`, scale = lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA.

The base model fuses q/k/v and gate/up into one projection each; an adapter's parts of a fused projection share one
shrink (their A stacked, [parts * R, in]) and one expand (their B placed block-diagonally, [out, parts * R]),
so each projection costs two grouped matmuls per step whatever the targets. Ranks below `max_lora_rank` and
projections an adapter does not target are zero-padded. The term is added by the projections themselves
(`QuantizableLinear.adapter_term`, set here on the four projections of each layer; in a row-parallel one before the
all-reduce), reading the step's row -> slot map the runner set (`begin_step`). On CUDA the Triton kernel
(conveyor_kernels/lora.py) handles any mix of rows in two launches; on the CPU the C++ kernel (conveyor_kernels/lora_cpu.cpp) in one
call, one pass per row over its own slot's weights, skipping the zero padding and the zero blocks of B, so its cost
does not grow with the adapters present (bench/lora.py, README: 0.86x-0.92x the base's tokens per CPU second
at 1-16 adapters, where the torch path below gave 0.63x-0.83x). Without the C++
kernels (cpu_kernels=False, or no compiler) the torch path: a step of few rows (decode) runs its slots at once, x
times the slots' A stacked, masked to each row's own slot's columns, times their B stacked (slots fill from 0, so the
stack is the slots up to the highest in use); a larger step groups its rows by slot, one pair of matmuls per
adapter present.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from engine.config import ModelConfig
from engine.models.llama import MLP, LlamaForCausalLM
from engine.parallel_layers import ColumnParallelLinear, QuantizableLinear, RowParallelLinear
from conveyor_kernels.lora import load_lora_cpu_kernels, lora_add, lora_add_cpu

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_TARGETS = ("gate_proj", "up_proj", "down_proj")
# The base model's fused projection -> the PEFT target modules it holds, in its output order.
_FUSED_PARTS = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}
_TENSOR_NAME = re.compile(
    r"^base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$"
)
# adapter_config.json options that change what the adapter computes and that this engine does not implement
_UNSUPPORTED_OPTIONS = (
    "use_dora", "lora_bias", "modules_to_save", "rank_pattern", "alpha_pattern", "layers_to_transform", "layer_replication",
    "target_parameters", "trainable_token_indices", "fan_in_fan_out",
)


@dataclass(frozen=True)
class LoRAAdapter:
    """One registered adapter, read once, kept in host memory until a slot needs it."""

    name: str
    rank: int
    scale: float  # lora_alpha / rank, or lora_alpha / sqrt(rank) with rsLoRA
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # (layer, PEFT module) -> (A [r, in], B [out, r])


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each PEFT target module's (in, out) features in the base model."""
    q, kv = config.num_attention_heads * config.head_dim, config.num_key_value_heads * config.head_dim
    hidden, inter = config.hidden_size, config.intermediate_size
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    if config.moe is None:  # a mixture of experts' MLPs are experts, which adapters here do not target
        shapes |= {"gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    return shapes


def load_adapter(name: str, folder: str | Path, config: ModelConfig, max_rank: int) -> LoRAAdapter:
    """Read and check a PEFT LoRA folder against the base model `config`; raises ValueError naming what is wrong."""
    folder = Path(folder)
    config_file, weights_file = folder / "adapter_config.json", folder / "adapter_model.safetensors"
    if not config_file.is_file() or not weights_file.is_file():
        raise ValueError(
            f"adapter {name!r}: {folder} is not a PEFT LoRA adapter folder (it needs adapter_config.json and "
            "adapter_model.safetensors)"
        )
    try:
        settings = json.loads(config_file.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"adapter {name!r}: adapter_config.json is not JSON ({error})") from error
    if settings.get("peft_type") != "LORA":
        raise ValueError(f"adapter {name!r}: peft_type is {settings.get('peft_type')!r}; only LORA adapters are served")
    rank, alpha = settings.get("r"), settings.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"adapter {name!r}: r must be an integer >= 1 and lora_alpha a number, got r={rank!r}, "
                         f"lora_alpha={alpha!r}")
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} is above max_lora_rank ({max_rank}); raise max_lora_rank")
    unsupported = [option for option in _UNSUPPORTED_OPTIONS if settings.get(option)]
    if settings.get("bias", "none") != "none":
        unsupported.append("bias")
    if unsupported:
        raise ValueError(f"adapter {name!r}: adapter_config.json sets {unsupported}, which this engine does not support")
    shapes = projection_shapes(config)
    targets = settings.get("target_modules")
    if not isinstance(targets, list) or not targets or set(targets) - set(shapes):
        raise ValueError(
            f"adapter {name!r}: target_modules {targets!r} must be a list of this model's projections {sorted(shapes)}"
        )
    weights = _read_weights(name, weights_file, config, rank, shapes, set(targets))
    scale = alpha / math.sqrt(rank) if settings.get("use_rslora") else alpha / rank
    return LoRAAdapter(name, rank, scale, weights)


def _read_weights(
    name: str, weights_file: Path, config: ModelConfig, rank: int, shapes: dict[str, tuple[int, int]], targets: set[str]
) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(weights_file)).items():
        match = _TENSOR_NAME.match(key)
        if match is None or match[2] not in targets or int(match[1]) >= config.num_hidden_layers:
            raise ValueError(f"adapter {name!r}: tensor {key!r} is not a LoRA weight of this model's target modules")
        halves.setdefault((int(match[1]), match[2]), {})[match[3]] = tensor.float()
    weights = {}
    for (layer, module), pair in halves.items():
        in_features, out_features = shapes[module]
        a, b = pair.get("A"), pair.get("B")
        if a is None or b is None or a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise ValueError(
                f"adapter {name!r}: layer {layer} {module} needs lora_A [{rank}, {in_features}] and lora_B "
                f"[{out_features}, {rank}], got {None if a is None else list(a.shape)} and "
                f"{None if b is None else list(b.shape)}"
            )
        weights[layer, module] = (a, b)
    if not weights:
        raise ValueError(f"adapter {name!r}: adapter_model.safetensors holds no LoRA weights")
    return weights


# CPU: steps of at most this many rows run every slot at once (masked), larger ones grouped by slot
_CPU_ALL_SLOTS_MAX_ROWS = 256


@dataclass(frozen=True)
class _StepRows:
    """The step's rows of each resident adapter: `token_slots` [T] for the kernel; on CPU either `slot_of_row` (the
    all-slots path, masked) or `groups` (rows grouped by slot)."""

    token_slots: torch.Tensor
    groups: list[tuple[int, torch.Tensor]]  # (slot, row indices)
    slot_of_row: torch.Tensor | None  # [T, 1] int64
    spanned: int  # slots 0 .. spanned - 1 hold every adapter of the step (slots fill from 0: usually just those present)


class _SlotProjection:
    """One fused projection's adapter slots: A [slots, parts * R, in], B [slots, out, parts * R]. Under tensor
    parallelism a slot holds this rank's shard, cut like the base layer's: a column-parallel projection's B keeps
    this rank's output rows of each part, a row-parallel projection's A this rank's input columns (its term is then
    a partial sum, added before the base's all-reduce)."""

    def __init__(self, module: QuantizableLinear, parts: tuple[str, ...], part_sizes: list[int], num_slots: int,
                 max_rank: int, dtype: torch.dtype, device: torch.device) -> None:
        self.parts, self.part_sizes, self.max_rank = parts, part_sizes, max_rank
        assert isinstance(module, ColumnParallelLinear | RowParallelLinear)
        self.row_parallel = isinstance(module, RowParallelLinear)
        self.rank, self.ranks = module.group.rank, module.group.size
        self.width = len(parts) * max_rank
        self.a = torch.zeros(num_slots, self.width, module.in_features, dtype=dtype, device=device)
        # B stored transposed, [slots, width, out], so the first k slots stacked are one [k * width, out] view;
        # `b` is the [slots, out, width] view the kernel reads
        self.b_t = torch.zeros(num_slots, self.width, module.out_features, dtype=dtype, device=device)
        self.b = self.b_t.permute(0, 2, 1)
        # Which rank rows each slot's adapter fills (its rank, its targeted parts): the C++ kernel skips the others
        self.used = torch.zeros(num_slots, self.width, dtype=torch.bool, device=device)
        # Each part's first output column, and the end: part p's rank rows expand into its columns only
        self.part_starts = [sum(part_sizes[:index]) for index in range(len(part_sizes) + 1)]
        # Each column of the stacked shrink output -> its slot, for the all-slots path's mask
        self.slot_of_column = torch.arange(num_slots, device=device).repeat_interleave(self.width)

    def load(self, slot: int, layer: int, adapter: LoRAAdapter) -> None:
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.used[slot] = False
        out_start = 0
        for index, (part, size) in enumerate(zip(self.parts, self.part_sizes)):
            pair = adapter.weights.get((layer, part))
            if pair is not None:
                a, b = pair
                if self.row_parallel:  # this rank's input columns
                    width = a.shape[1] // self.ranks
                    a = a[:, self.rank * width : (self.rank + 1) * width]
                else:  # this rank's output rows of the part
                    b = b[self.rank * size : (self.rank + 1) * size]
                column = index * self.max_rank
                self.a[slot, column : column + adapter.rank] = a
                self.b[slot, out_start : out_start + size, column : column + adapter.rank] = b * adapter.scale
                self.used[slot, column : column + adapter.rank] = True
            out_start += size


class LoRASlotWeights:
    """The device's `num_slots` adapter slots over every layer of `model` (this rank's shard of each), and the terms
    the projections add with them."""

    def __init__(self, model: LlamaForCausalLM, num_slots: int, max_rank: int, use_triton: bool) -> None:
        parameter = next(model.parameters())
        self.use_triton = use_triton
        # The C++ kernel where the model runs its CPU kernels (float32, bfloat16) and it builds; else the torch path
        self.use_cpu_kernel = (
            not use_triton and model.kernels == "cpu" and parameter.dtype in (torch.float32, torch.bfloat16)
            and load_lora_cpu_kernels() is not None
        )
        self._projections: list[tuple[int, _SlotProjection]] = []
        self._rows: _StepRows | None = None
        self._offsets: dict[int, int] = {}  # per projection: rows already seen this step (a CPU MLP runs in slices)
        for layer_index, layer in enumerate(model.model.layers):
            modules = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj}
            if isinstance(layer.mlp, MLP):
                modules |= {"gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
            for fused, module in modules.items():
                parts = _FUSED_PARTS[fused]
                sizes = list(module.local_part_sizes) if len(parts) > 1 else [module.out_features]
                projection = _SlotProjection(module, parts, sizes, num_slots, max_rank, parameter.dtype, parameter.device)
                self._projections.append((layer_index, projection))
                module.adapter_term = self._term(projection)

    def load(self, slot: int, adapter: LoRAAdapter) -> None:
        """Copy `adapter` into `slot`, over whatever was there."""
        for layer, projection in self._projections:
            projection.load(slot, layer, adapter)

    def begin_step(self, token_slots: list[int], device: torch.device) -> bool:
        """The step's slot per token row (-1: base model); returns whether any row runs an adapter (rows of none
        cost nothing)."""
        if all(slot < 0 for slot in token_slots):
            self._rows = None
            return False
        by_slot: dict[int, list[int]] = {}
        for row, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(row)
        per_row = self.use_triton or self.use_cpu_kernel  # kernels that take each row's slot as it is
        all_slots = not per_row and len(token_slots) <= _CPU_ALL_SLOTS_MAX_ROWS
        groups = [] if per_row or all_slots else [
            (slot, torch.tensor(rows, dtype=torch.int64, device=device)) for slot, rows in by_slot.items()
        ]
        slot_of_row = torch.tensor(token_slots, device=device).unsqueeze(1) if all_slots else None
        self._rows = _StepRows(
            torch.tensor(token_slots, dtype=torch.int32, device=device), groups, slot_of_row, max(by_slot) + 1
        )
        self._offsets.clear()
        return True

    def end_step(self) -> None:
        self._rows = None

    def _term(self, projection: _SlotProjection) -> Callable[[torch.Tensor, torch.Tensor], None]:
        def add_adapter_terms(x: torch.Tensor, output: torch.Tensor) -> None:
            rows = self._rows
            if rows is None:
                return
            total = rows.token_slots.shape[0]
            start = self._offsets.get(id(projection), 0)
            self._offsets[id(projection)] = (start + x.shape[0]) % total
            if self.use_triton:
                lora_add(x, projection.a, projection.b, rows.token_slots[start : start + x.shape[0]], output)
                return
            if self.use_cpu_kernel:
                lora_add_cpu(x, projection.a, projection.b_t, rows.token_slots[start : start + x.shape[0]],
                             projection.used, projection.part_starts, output)
                return
            if rows.slot_of_row is not None:  # the first `spanned` slots at once, each row masked to its own
                columns = rows.spanned * projection.width
                own_slot = projection.slot_of_column[:columns] == rows.slot_of_row[start : start + x.shape[0]]
                shrunk = (x @ projection.a[: rows.spanned].flatten(0, 1).T) * own_slot
                output.addmm_(shrunk, projection.b_t[: rows.spanned].flatten(0, 1))
                return
            for slot, indices in rows.groups:
                if x.shape[0] != total:  # a slice of the step's rows (the CPU MLP's): its rows of this slot
                    indices = indices[(indices >= start) & (indices < start + x.shape[0])] - start
                selected = x.index_select(0, indices)
                delta = (selected @ projection.a[slot].T) @ projection.b_t[slot]
                output.index_add_(0, indices, delta)

        return add_adapter_terms
