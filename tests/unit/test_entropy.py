"""The entropy stage over a quantized message's bytes (aqpipe/compression/entropy.py): lossless, shorter where codes are
skewed, never longer than its receiver's buffer, and a clear error for a message that does not decode."""
import pytest
import torch

from aqpipe.compression import entropy, quantize
from aqpipe.pipeline.transport import Wire


def _packed(bits: int, group_size=None, rows: int = 512, width: int = 256) -> torch.Tensor:
    x = torch.randn(rows, width, generator=torch.Generator().manual_seed(bits))
    return quantize(x, bits, group_size=group_size, generator=torch.Generator().manual_seed(0)).to_bytes()


def _landed(coded: torch.Tensor, n: int) -> torch.Tensor:
    """`coded` at the front of a receive posted for an n-byte message, the rest stale bytes."""
    buf = torch.full((entropy.capacity(n),), 0xA5, dtype=torch.uint8)
    buf[: coded.numel()] = coded
    return buf


MESSAGES = {
    "2-bit groups of 64": lambda: _packed(2, 64),
    "3-bit rows": lambda: _packed(3),
    "4-bit rows": lambda: _packed(4),
    "8-bit rows": lambda: _packed(8),
    "bfloat16 rows": lambda: torch.randn(256, 256).bfloat16().reshape(-1).view(torch.uint8),
    "random bytes": lambda: torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=torch.Generator()),
    "short": lambda: torch.arange(40, dtype=torch.uint8),
    "empty": lambda: torch.empty(0, dtype=torch.uint8),
    "thirds of unequal length": lambda: _packed(4, rows=200),  # 27200 bytes: thirds, n % 3 = 2
    "one stream, just short of thirds": lambda: _packed(4, rows=120),  # 16320 bytes
}


@pytest.mark.parametrize("name", MESSAGES)
def test_every_message_decodes_to_itself_within_its_receivers_buffer(name):
    message = MESSAGES[name]()
    coded = entropy.encode(message)
    assert coded.numel() <= entropy.capacity(message.numel())
    assert torch.equal(entropy.decode(_landed(coded, message.numel()), message.numel()), message)


@pytest.mark.parametrize("bits,group,layout,most", [
    (2, 64, entropy.WHOLE, 0.87), (3, None, entropy.INTERLEAVED, 0.89), (4, None, entropy.WHOLE, 0.90),
])
def test_skewed_codes_get_their_layout_and_shrink(bits, group, layout, most):
    """Gaussian rows' codes carry 1.7 / 2.5 / 3.5 bits at 2 / 3 / 4 bits: a Huffman coder takes 11-16% off (3-bit
    codes straddle bytes: coded as one stream they keep 0.95 of their bytes, which this bound fails)."""
    message = _packed(bits, group)
    coded = entropy.encode(message)
    assert int(coded[0]) == layout
    assert coded.numel() < most * message.numel()


def test_a_long_message_is_cut_in_thirds_and_a_short_one_kept_whole():
    """Thirds give three threads a stream each and keep a message's scales (at its front) apart from its codes."""
    for rows, streams in ((200, 3), (120, 1)):
        coded = entropy.encode(_packed(4, rows=rows))
        assert int(coded[0]) == entropy.WHOLE
        first, second = coded[1:entropy._HEADER].clone().view(torch.int32).tolist()
        assert (first > 0, second > 2, coded.numel() - entropy._HEADER - first - second > 2) == (
            True, streams == 3, streams == 3)


def test_bytes_a_coder_cannot_shrink_travel_raw_at_one_byte_more():
    message = MESSAGES["random bytes"]()
    coded = entropy.encode(message)
    assert int(coded[0]) == entropy.RAW and coded.numel() == message.numel() + 1


@pytest.mark.parametrize("damage", ["layout", "truncated", "garbled", "longer"])
def test_a_message_that_does_not_decode_is_named(damage):
    message = _packed(3)
    coded = entropy.encode(message).clone()
    n = message.numel()
    if damage == "layout":
        coded[0] = 7
    elif damage == "truncated":
        coded = coded[: coded.numel() // 2]
    elif damage == "garbled":
        coded[entropy._HEADER:] = 0xFF
    else:  # the receiver expects more than was sent
        n += 10
    with pytest.raises(entropy.CorruptMessage, match="entropy-coded message|raw message"):
        entropy.decode(coded, n)


def test_a_wire_codes_only_over_a_host_transport():
    """NCCL needs a receive's size to match its send's: a GPU transport sends the codes as packed."""
    assert Wire(transport="cpu", entropy=True).entropy
    assert not Wire(transport="cuda", entropy=True).entropy
    assert not Wire(transport="cpu").entropy
