"""A last stage's loss inputs for the causal-LM loss tests: hidden states, a Linear head, labels with a prompt's
positions ignored; and the check every loss path passes for a micro-batch with no targets."""
import torch


def head_case(seed: int, shape: tuple[int, int, int, int], bias: bool = False
              ) -> tuple[torch.Tensor, torch.nn.Linear, torch.Tensor]:
    """(hidden (B, T, H) requiring a gradient, a Linear H -> V head, labels (B, T)) for `shape` = (B, T, H, V)."""
    rows, positions, hidden_size, vocab = shape
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(rows, positions, hidden_size, generator=g, requires_grad=True)
    head = torch.nn.Linear(hidden_size, vocab, bias=bias)
    torch.nn.init.normal_(head.weight, generator=g)
    labels = torch.randint(0, vocab, (rows, positions), generator=g)
    labels[0, :5] = -100  # a prompt's positions, ignored
    return hidden, head, labels


def assert_no_targets_train_nothing(loss_of) -> None:
    """`loss_of(head, hidden, labels)` over labels with no target (-100 but at position 0, which is never predicted):
    a loss of exactly 0 and zero gradients, not 0/0 (a NaN would reject the whole step)."""
    hidden, head, labels = head_case(5, (2, 11, 16, 50), bias=True)
    labels[:, 1:] = -100
    loss = loss_of(head, hidden, labels)
    grads = torch.autograd.grad(loss, [hidden, *head.parameters()])
    assert loss.item() == 0.0
    assert all(torch.equal(g, torch.zeros_like(g)) for g in grads)
