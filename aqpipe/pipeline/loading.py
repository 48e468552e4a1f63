"""One stage built alone: its modules on the meta device, then only its own tensors, read from the checkpoint.

    stage, ties = build_stage(LlamaForCausalLM, config, stage_index=1, num_stages=4, checkpoint="path/to/model")

The whole model is constructed on the meta device (shapes only, no memory), split as `partition` splits it, and
only this stage's parameters are made real: read one tensor at a time from the checkpoint's safetensors shards
(`model.safetensors.index.json`, or a single `model.safetensors`), cast to the training dtype as they come, so a
rank's host memory holds its stage, never the model. A tied weight the checkpoint stores once (Llama 3.2's and
Qwen2.5's head, GPT2's) is read under its other name. What the checkpoint lacks (a new classification head) and every
buffer (rotary frequencies, position ids: in no checkpoint) is initialized by the model's own `_init_weights`, the
generator seeded per module name, so a model without weights (a config.json) starts from the same values on any
stage count.
"""
from __future__ import annotations

import copy
import json
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .partitioning import model_family, partition, tie_groups
from .quantized_base import FourBit, is_four_bit, quantize_into, swap_in
from .seeding import derive_seed
from .stages import PipelineStage
from .ties import Tie

INDEX, SINGLE = "model.safetensors.index.json", "model.safetensors"
BIN_INDEX, BIN = "pytorch_model.bin.index.json", "pytorch_model.bin"


def has_weights(directory: str | os.PathLike) -> bool:
    return any((Path(directory) / name).is_file() for name in (INDEX, SINGLE, BIN_INDEX, BIN))


class CheckpointReader:
    """The tensors of an HF checkpoint directory by name, each read alone (safetensors: memory-mapped, so reading
    one tensor touches only its bytes). Counts what it read: `read` names, `bytes_read`."""

    def __init__(self, directory: str | os.PathLike, fetch: Callable[[str], Path] | None = None) -> None:
        """`fetch(file)`: where a file of the checkpoint is, after bringing it here (a hub snapshot's shards, fetched
        when first read); default: the directory's own files."""
        self.directory = Path(directory)
        self.fetch = fetch or (lambda file: self.directory / file)
        self.read: list[str] = []
        self.bytes_read = 0
        d = self.directory
        if (d / INDEX).is_file():
            self.files = self._index(d / INDEX)
            self.kind = "safetensors"
        elif (d / SINGLE).is_file():
            from safetensors import safe_open

            with safe_open(str(self.fetch(SINGLE)), framework="pt") as f:
                self.files = dict.fromkeys(f.keys(), SINGLE)
            self.kind = "safetensors"
        elif (d / BIN_INDEX).is_file() or (d / BIN).is_file():
            self.files = self._index(d / BIN_INDEX) if (d / BIN_INDEX).is_file() else None
            self.kind = "bin"
            warnings.warn(f"{d}: a .bin checkpoint is read whole (memory-mapped) by every rank; its safetensors form "
                          "lets each rank read only its stage's tensors", stacklevel=2)
        else:
            raise FileNotFoundError(f"{d}: no model weights (expected {INDEX}, {SINGLE}, {BIN_INDEX} or {BIN})")
        self._bin: dict[str, dict[str, torch.Tensor]] = {}

    @staticmethod
    def _index(path: Path) -> dict[str, str]:
        try:
            return dict(json.loads(path.read_text())["weight_map"])
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"{path}: not a checkpoint index with a weight_map ({exc})") from None

    def names(self) -> set[str]:
        if self.files is None:  # a single .bin: its names are known once it is mapped
            self.files = dict.fromkeys(self._bin_file(BIN), BIN)
        return set(self.files)

    def _bin_file(self, file: str) -> dict[str, torch.Tensor]:
        if file not in self._bin:
            self._bin[file] = torch.load(self.fetch(file), map_location="cpu", mmap=True, weights_only=True)
        return self._bin[file]

    def get(self, name: str) -> torch.Tensor:
        """The tensor `name`, as stored (its checkpoint dtype). Its shard is opened for it alone: a memory map left
        open keeps every page read through it resident, so a rank would hold its stage twice while loading."""
        file = BIN if self.files is None else self.files[name]
        if self.kind == "bin":
            tensor = self._bin_file(file)[name]
        else:
            from safetensors import safe_open

            with safe_open(str(self.fetch(file)), framework="pt") as f:
                tensor = f.get_tensor(name)
        self.read.append(name)
        self.bytes_read += tensor.numel() * tensor.element_size()
        return tensor

    def close(self) -> None:
        self._bin.clear()


def meta_model(model_class: type, config: Any) -> nn.Module:
    """The whole model on the meta device: its module tree, shapes and ties, no storage (its initialization on
    meta tensors does nothing). Built in float32 whatever the checkpoint's dtype: buffers computed at construction
    (Gemma 3's embedding scale) keep float32's precision, as in transformers' own float32 model."""
    with torch.device("meta"):
        return model_class._from_config(config, dtype=torch.float32)


def materialize(module: nn.Module, dtype: torch.dtype, device: torch.device | str) -> None:
    """Give every meta parameter and buffer of `module` real (uninitialized) storage: floating parameters in
    `dtype`, buffers in their own dtype. A parameter several submodules share stays one parameter."""
    made: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for name, p in list(m.named_parameters(recurse=False)):
            if name == "weight" and is_four_bit(m):
                continue  # made real as it is read, in 4 bits (quantized_base.py)
            if id(p) not in made:
                kind = dtype if p.is_floating_point() else p.dtype
                made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=kind, device=device),
                                           requires_grad=p.requires_grad)
            setattr(m, name, made[id(p)])
        for name, b in list(m.named_buffers(recurse=False)):
            if b.is_meta:
                setattr(m, name, torch.empty(b.shape, dtype=b.dtype, device=device))


def _postorder(module: nn.Module, prefix: str = "") -> Iterator[tuple[str, nn.Module]]:
    for name, child in module.named_children():
        yield from _postorder(child, f"{prefix}.{name}" if prefix else name)
    yield prefix, module


def _initializer(model: nn.Module, path: str) -> Any:
    """The `_init_weights` of the innermost pretrained model around `path` (a composite's parts have their own)."""
    from transformers import PreTrainedModel

    owner, node = model, model
    for part in path.split(".") if path else ():
        node = getattr(node, part)
        if isinstance(node, PreTrainedModel):
            owner = node
    return owner._init_weights


def _mark(tensor: torch.Tensor) -> None:
    tensor._is_hf_initialized = True  # transformers' own flag: its init functions leave such a tensor alone


def _seeded_init(model: nn.Module, path: str, module: nn.Module, seed: int) -> None:
    """What `module` (its subtree: an init may reach into children, as GPT2's does for c_proj) holds that no
    checkpoint gave, by the model's `_init_weights` under a generator seeded by the module's name, always drawn on
    the CPU: a GPU's generator draws other values from the same seed, and a job starts from the same weights on any
    device. Tensors not yet initialized that live on another device visit the CPU for the draw."""
    visiting: dict[int, tuple[nn.Module, str, torch.device]] = {}
    for owner in module.modules():
        for table in (owner._parameters, owner._buffers):
            for name, t in table.items():
                if t is None or t.device.type == "cpu" or getattr(t, "_is_hf_initialized", False) or id(t) in visiting:
                    continue
                visiting[id(t)] = (owner, name, t.device)
                if isinstance(t, nn.Parameter):
                    t.data = t.data.cpu()  # the same Parameter (ties and optimizers keep it), its data on the CPU
                else:
                    table[name] = t.cpu()
    try:
        with torch.no_grad():
            torch.manual_seed(derive_seed(seed, "init", path))
            _initializer(model, path)(module)
    finally:
        for owner, name, device in visiting.values():
            if name in owner._parameters:
                param = owner._parameters[name]
                param.data = param.data.to(device)
            else:
                owner._buffers[name] = owner._buffers[name].to(device)


def vocabulary_weights(model: nn.Module) -> set[str]:
    """The HF names of the weights with a row per token: the input embeddings and the output head."""
    tables = {id(m.weight) for m in (model.get_input_embeddings(), model.get_output_embeddings()) if m is not None}
    return {name for name, p in model.named_parameters(remove_duplicate=False) if id(p) in tables}


def _fill(param: torch.Tensor, value: torch.Tensor, name: str, grows: bool = False) -> None:
    """Copy a checkpoint tensor in, cast to the parameter's dtype. A vocabulary table (`grows`) larger than the
    checkpoint's (a tokenizer with more tokens) keeps the stored rows and gives each new one their mean."""
    with torch.no_grad():
        if value.shape == param.shape:
            param.copy_(value)
            return
        if grows and value.dim() == param.dim() and value.shape[1:] == param.shape[1:] and \
                value.shape[0] < param.shape[0]:
            param[:value.shape[0]].copy_(value)
            param[value.shape[0]:].copy_(value.float().mean(0, keepdim=True).to(param.dtype))
            return
    raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(value.shape)}; the model expects "
                     f"{tuple(param.shape)}")


def checkpoint_names(model: nn.Module, stored: set[str]) -> dict[str, str]:
    """Each model name the checkpoint has a tensor for -> that tensor's stored name, by transformers' own key
    renamings (a base model's checkpoint without the head model's prefix, legacy LayerNorm gamma/beta). A checkpoint
    needing a tensor conversion (fused projections split) is refused: a stage reads tensors as stored."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    expected, out = model.state_dict(), {}
    for key in sorted(stored):
        name, converted = rename_source_key(key, renamings, converters, model.base_model_prefix, expected)
        if converted is not None:
            raise ValueError(f"checkpoint tensor {key!r} needs transformers' conversion {converted!r}, which per-stage "
                             "loading does not apply: save the model with transformers 5 first")
        out.setdefault(name, key)
    return out


def weight_names(model: nn.Module) -> dict[str, list[str]]:
    """Each weight's names in the model, by any of them: a tied weight has several."""
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    return {name: group for group in groups.values() for name in group}


def load_weights(stage: PipelineStage, reader: CheckpointReader, model: nn.Module, aliases: dict[str, list[str]],
                 vocabulary: set[str], device: torch.device | str = "cpu") -> list[str]:
    """Read the stage's tensors from the checkpoint, each under any of its names in the whole model (`aliases`,
    taken before the stage was made real: a tied weight is stored under one of its names), as transformers renames
    stored keys; marks them loaded. The `vocabulary` tables (a row per token) may grow. Returns the local names the
    checkpoint lacks."""
    stored = checkpoint_names(model, reader.names())
    origin, missing = stage.hf_parameter_names(), []
    for local, param in list(stage.named_parameters()):
        found = next((n for n in (local, *aliases[origin[local]]) if n in stored), None)
        if found is None:
            missing.append(local)
            continue
        path, _, leaf = local.rpartition(".")
        owner = stage.get_submodule(path) if path else stage
        if leaf == "weight" and is_four_bit(owner):  # one tensor in bf16 at a time: kept in its 4-bit form only
            try:
                quantize_into(owner, reader.get(stored[found]), device)
            except ValueError as exc:
                raise ValueError(f"checkpoint tensor {stored[found]!r}: {exc}") from None
            continue
        _fill(param, reader.get(stored[found]), stored[found], grows=local in vocabulary)
        _mark(param)
    for local in set(stage.state_dict()) - set(aliases):  # persistent buffers a checkpoint may carry
        if local in stored:
            buffer = stage.get_buffer(local)
            _fill(buffer, reader.get(stored[local]), stored[local])
            _mark(buffer)
    return missing


def init_weights(stage: PipelineStage, model: nn.Module, seed: int) -> None:
    """Initialize what no checkpoint gave (every parameter without one, every buffer) with the model's own
    `_init_weights`, each module's generator seeded by its HF name: the same values on any stage count.

    A tied weight takes the values its first name's module gives it (the embedding's, zero padding row included),
    never the other holder's (a head's): that module is built here for the purpose where this stage lacks it."""
    origin = stage.hf_parameter_names()
    name_of = {id(p): origin[local] for local, p in stage.named_parameters()}
    for local, name in origin.items():  # tied weights whose first name's module is another stage's
        param, source_path = stage.get_parameter(local), name.rpartition(".")[0]
        if local == name or getattr(param, "_is_hf_initialized", False):
            continue
        source = copy.deepcopy(model.get_submodule(source_path))
        materialize(source, param.dtype, "cpu")  # drawn on the CPU in any case (_seeded_init)
        _seeded_init(model, source_path, source, seed)
        with torch.no_grad():
            param.copy_(source.get_parameter(name.rpartition(".")[2]))
        _mark(param)
    for path, module in _postorder(stage):
        if not path:
            continue
        # a weight tied to another module's is that module's to initialize: kept as it is while this one runs
        others = [p for p in module.parameters() if not name_of[id(p)].startswith(path + ".")
                  and not getattr(p, "_is_hf_initialized", False)]
        for p in others:
            _mark(p)
        _seeded_init(model, path, module, seed)
        for p in others:
            del p._is_hf_initialized
    for tensor in [*stage.parameters(), *stage.buffers()]:
        if hasattr(tensor, "_is_hf_initialized"):
            del tensor._is_hf_initialized


def build_stage(model_class: type, config: Any, stage_index: int, num_stages: int, *,
                checkpoint: str | os.PathLike | None = None, partition_method: str | list[int] = "parameters",
                seed: int = 0, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu",
                activation_checkpointing: bool = False, reader: CheckpointReader | None = None,
                four_bit: FourBit | None = None) -> tuple[PipelineStage, dict[str, Tie], list[str]]:
    """Stage `stage_index` of `num_stages` of `model_class(config)`, its weights from `checkpoint` (a model
    directory) or `reader`, else seeded from `seed`; returns it, the job's ties (`tie_groups` of every stage) and
    the names of the parameters the checkpoint lacked (initialized). `four_bit`: the blocks' linears held in 4 bits
    as they are read (quantized_base.py; QLoRA's frozen base)."""
    model = meta_model(model_class, config)
    family = model_family(model)  # refuses an unsupported class or configuration before anything is made
    stages = partition(model, num_stages, partition_method, activation_checkpointing, copy_modules=False)
    ties, stage = tie_groups(stages), stages[stage_index]
    del stages
    aliases, vocabulary = weight_names(model), vocabulary_weights(model)  # while the model still holds its ties
    reader = reader or (CheckpointReader(checkpoint) if checkpoint is not None else None)
    if four_bit is not None:
        if reader is None:
            raise ValueError(f"--load_in_4bit: model {model_class.__name__} has no weights to quantize; expected a "
                             "model directory or hub name with its checkpoint")
        origin = stage.hf_parameter_names()
        if not swap_in(stage, origin, lambda name: name in vocabulary or family.in_head(name), four_bit):
            raise ValueError(f"--load_in_4bit: stage {stage_index} of {model_class.__name__} has no nn.Linear in "
                             "its blocks to hold in 4 bits (GPT2's are Conv1D); expected a Llama-lineage, BERT or "
                             "DeBERTa model")
        stage.is_loaded_in_4bit = True  # PEFT's LoRA wraps bitsandbytes' layers by this mark
    # a seeded init is drawn on the CPU (the same weights on any device) and moved once; a checkpoint is read where
    # the stage computes, its few missing tensors visiting the CPU for their draw (_seeded_init)
    materialize(stage, dtype, device if reader is not None else "cpu")
    missing = [name for name, _ in stage.named_parameters()]
    if reader is not None:
        try:
            missing = load_weights(stage, reader, model, aliases, vocabulary, device)
        finally:
            reader.close()
        body = [name for name in missing if not family.in_head(name)]
        if body:  # a checkpoint of the task's base model may lack the head; lacking more is the wrong checkpoint
            raise ValueError(f"checkpoint {reader.directory}: {len(body)} of stage {stage_index}'s weights outside "
                             f"its head are not in it (first: {body[0]!r}); expected a checkpoint of "
                             f"{model_class.__name__} or its base model")
    init_weights(stage, model, seed)
    stage.to(device)
    stage.train()
    return stage, ties, missing
