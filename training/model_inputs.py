"""A batch from the data pipeline (training.data) as keyword arguments of BertForPreTraining: the masked
positions gathered to a fixed width, optionally padded to one length or packed without padding
(training.packed); built on the CPU (in a data worker) and then moved to the device."""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from training.batch_stream import map_leaves
from training.packed import pack


def gather_masked(mlm_labels: torch.Tensor, max_predictions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, S] labels (-100 = not predicted) -> ([B, P] positions, [B, P] labels), P = max_predictions.

    Masked positions come first in sequence order; unused slots point at position 0 with label -100.
    A fixed P keeps every batch the same shape, so torch.compile traces the model once."""
    masked = mlm_labels != -100  # [B, S]
    most = int(masked.sum(1).max()) if masked.numel() else 0
    if most > max_predictions:
        raise ValueError(f"a sequence has {most} masked positions, more than max_predictions {max_predictions}")
    order = torch.sort(masked.to(torch.int32), dim=1, descending=True, stable=True).indices[:, :max_predictions]
    labels = mlm_labels.gather(1, order)  # [B, P]
    positions = torch.where(labels != -100, order, torch.zeros_like(order))
    return positions, labels


def model_inputs(batch: dict[str, torch.Tensor], max_predictions: int, device: torch.device,
                 pad_to: int | None = None, unpad: bool = False, token_multiple: int | None = None) -> dict[str, Any]:
    """A batch from the data pipeline as keyword arguments of BertForPreTraining, on `device`."""
    return inputs_to_device(cpu_inputs(batch, max_predictions, pad_to, unpad, token_multiple), device)


def cpu_inputs(batch: dict[str, torch.Tensor], max_predictions: int, pad_to: int | None = None,
               unpad: bool = False, token_multiple: int | None = None) -> dict[str, Any]:
    """The CPU half of model_inputs (a data worker runs it).

    The pipeline pads each batch to its longest row; `pad_to` pads further to a fixed length so that a
    compiled model sees one shape (eager mode is better off without the extra padding). `unpad` then
    removes all padding: the model runs on the real tokens only (training.packed), filled up to a multiple
    of `token_multiple` tokens with filler sequences if given (for CUDA graphs: few distinct shapes)."""
    if pad_to is not None and batch["input_ids"].shape[1] < pad_to:
        extra = pad_to - batch["input_ids"].shape[1]
        batch = {**batch, **{k: F.pad(batch[k], (0, extra), value=0) for k in
                             ("input_ids", "token_type_ids", "attention_mask")},
                 "mlm_labels": F.pad(batch["mlm_labels"], (0, extra), value=-100)}
    if unpad:
        return _packed_inputs(batch, max_predictions, token_multiple)
    positions, labels = gather_masked(batch["mlm_labels"], max_predictions)
    return {
        "input_ids": batch["input_ids"],
        "token_type_ids": batch["token_type_ids"],
        "attention_mask": batch["attention_mask"],
        "mlm_labels": labels,
        "nsp_labels": batch["nsp_labels"],
        "masked_positions": positions,
    }


def inputs_to_device(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """The device half of model_inputs (the training process runs it)."""
    inputs = _on_device(inputs, device)
    if inputs.get("packed") is not None:
        # The token count changes every batch: compile for any count at once instead of for the first.
        for tokens in (inputs["input_ids"], inputs["token_type_ids"], inputs["packed"].position_ids):
            torch._dynamo.maybe_mark_dynamic(tokens, 0)
    return inputs


def _packed_inputs(batch: dict[str, torch.Tensor], max_predictions: int,
                   token_multiple: int | None) -> dict[str, Any]:
    if bool(((batch["mlm_labels"] != -100) & (batch["attention_mask"] == 0)).any()):
        raise ValueError("an MLM label sits on a padding position")
    positions, labels = gather_masked(batch["mlm_labels"], max_predictions)
    token_index, packed = pack(batch["attention_mask"], token_multiple)
    # Masked positions move to the packed rows; unused slots (label -100) point at their row's [CLS].
    positions = positions + packed.first_tokens[:, None]
    extra = int(packed.cu_seqlens[-1]) - token_index.numel()  # filler tokens: id 0, segment 0
    return {
        "input_ids": F.pad(batch["input_ids"].flatten()[token_index], (0, extra)),  # [T]
        "token_type_ids": F.pad(batch["token_type_ids"].flatten()[token_index], (0, extra)),
        "attention_mask": None,
        "mlm_labels": labels,
        "nsp_labels": batch["nsp_labels"],
        "masked_positions": positions,
        "packed": packed,
    }


def _on_device(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    if device.type == "cuda":  # pin_memory() returns a tensor the stream's thread already pinned as it is
        return map_leaves(lambda t: t.pin_memory().to(device, non_blocking=True), torch.Tensor, inputs)
    return map_leaves(lambda t: t.to(device), torch.Tensor, inputs)
