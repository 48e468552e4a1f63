"""An AQ-SGD buffer's state (`SampleBuffer.state_dict`: the samples of its slots and their rows) read by sample."""
import torch


def by_sample(state: dict, num_samples: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each sample holds a row, every sample's row: zeros where none), as a buffer with a row per sample
    would hold them."""
    ids, rows = state["ids"], state["rows"]
    seen = torch.zeros(num_samples, dtype=torch.bool)
    seen[ids] = True
    dense = torch.zeros((num_samples, *rows.shape[1:]), dtype=rows.dtype)
    dense[ids] = rows
    return seen, dense
