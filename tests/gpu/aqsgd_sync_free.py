"""Run by test_cuda_path in a process of its own, where Triton compiles (the suite's runs interpret it, which copies
every tensor to the host): a boundary's AQ-SGD codecs, checks deferred as every pipeline boundary sets them, encode
and decode first visits, mixed micro-batches and changes on the GPU with no synchronizing call (torch's sync debug
mode raises at one), the two sides' buffers landing bit-identical; the same codecs with their checks read at once do
sync. Prints `no sync: <case> <messages>` per buffer kind; raises at the first failure. Without a GPU (the suite's
check of this harness) the same steps run on the CPU, where nothing can sync: the rest of the checks hold there too."""
from __future__ import annotations

import torch

from aqpipe.compression import forward_codec, Message

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
STEPS = [[[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1, 8, 9], [2, 3, 10, 11]], [[4, 5, 6, 7], [8, 9, 10, 11]]]


def _strict(fn):
    """`fn()` with every synchronizing CUDA call an error (on a GPU)."""
    if DEVICE == "cpu":
        return fn()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return fn()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _activation(ids: list[int], step: int) -> torch.Tensor:
    """Each sample's activation, drifting a little each step: the change AQ-SGD sends is small against it."""
    rows = [torch.randn(64, 256, generator=torch.Generator().manual_seed(i))
            + 0.02 * step * torch.randn(64, 256, generator=torch.Generator().manual_seed(100 + 10 * i + step))
            for i in ids]
    return torch.stack(rows)


def check(buffer_bits: int | None) -> int:
    kw = {"num_samples": 12, "sample_shape": (64, 256), "buffer_bits": buffer_bits, "first_visit": "direct",
          "first_visit_bits": 4}
    send, recv = forward_codec("aqsgd", 2, seed=3, **kw), forward_codec("aqsgd", 2, **kw)
    send.defer_checks()
    recv.defer_checks()
    messages, host = 0, [forward_codec("aqsgd", 2, seed=3, **kw), forward_codec("aqsgd", 2, **kw)]  # checks at once
    inputs = [[_activation(mb, step).to(DEVICE) for mb in micro_batches] for step, micro_batches in enumerate(STEPS)]
    for step, (micro_batches, xs) in enumerate(zip(STEPS, inputs)):
        ids = [torch.tensor(mb) for mb in micro_batches]

        def schedule():
            sent, got = [], []
            for x, mb in zip(xs, ids):
                msg = send.encode(x, mb)
                sent.append(msg.decoded)
                got.append(recv.decode(Message(msg.payload.clone(), msg.shape, msg.dtype), mb))
            return sent, got, send.take_checks() + recv.take_checks()

        sent, got, checks = _strict(schedule)
        messages += len(sent)
        assert send.end_step() is None and recv.end_step() is None
        assert all(torch.equal(a, b) for a, b in zip(sent, got)), f"step {step}: the receiver decoded otherwise"
        assert len(checks) >= len(micro_batches) and all(bool(torch.isfinite(c)) for c in checks), checks
        for x, mb, y in zip(xs, ids, got):  # the same codecs on the CPU: a change taken against a row not yet
            ref = host[1].decode(host[0].encode(x.cpu(), mb), mb)  # landed (zeros) would err by far more
            gap = float((y.cpu() - ref).abs().mean())
            assert gap < 1e-3, f"step {step}, samples {mb.tolist()}: {gap} from the CPU's decode"
    # the rows of each step landed on the worker thread while the next step ran (its reads of them waited for it);
    # a read of every row waits for the last landing
    sent_rows, got_rows = send.buffer.state_dict(), recv.buffer.state_dict()
    assert torch.equal(sent_rows["ids"], got_rows["ids"]), "the buffers hold other samples"
    assert torch.equal(sent_rows["rows"], got_rows["rows"]), "the buffers differ"
    held = recv.buffer.rows(ids[-1], DEVICE)  # the last step's changes: computed with the rows both now hold
    assert torch.equal(held, got[-1].to(held.dtype)), "the receiver computed with other rows than it holds"
    if DEVICE == "cpu":
        return messages
    immediate = forward_codec("aqsgd", 2, **kw)
    try:
        _strict(lambda: immediate.encode(xs[0], ids[0]))
    except RuntimeError as exc:
        assert "synchroniz" in str(exc), exc
    else:
        raise AssertionError("a codec reading its checks at once made no synchronizing call: the mode caught nothing")
    return messages


def main() -> None:
    for name, bits in (("float16-rows", None), ("8-bit-rows", 8)):
        print(f"{'no sync' if DEVICE == 'cuda' else 'checked on the CPU'}: {name} {check(bits)}")


if __name__ == "__main__":
    main()
