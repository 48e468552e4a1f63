"""A boundary's activations as k coefficients in a basis both sides hold: fewer than one value per element.

A pretrained model's residual stream keeps almost all its energy in a few directions (benchmarks/boundary_spectrum.py:
on the WAN workload's pretrained start, rank 32 of width 256 keeps 99.84% of a held-out boundary's energy). The
sender estimates the top-k eigenvectors of its activations' uncentred second moment and sends them (bfloat16), with
each direction's root-mean-square (float32), in the first message of steps 0, 1, 2, 4, 8, ... (a refresh: its
bytes are the message's, so they count in the wire's). Each token then travels as k coefficients, each divided by
its direction's scale (whitened: the massive directions of a pretrained stream would otherwise set every other
coefficient's step) and quantized per token; the receiver decodes x ~ (c * scale) U^T.

The backward travels in one of two bases (`backward_basis`):
- `activations`: the forward's. The forward delivers x U U^T (U orthonormal), whose gradient with respect to x is
  g U U^T: the stage after sends g U (k values a token) and the stage before expands it. That is the exact gradient
  of the model the pipeline runs, the projection inside it: what the projection drops is invisible to the loss, so
  the stage before gets no gradient for it. Both directions of one side of a boundary then share one `Subspace`.
- `own`: a basis of the gradients' own, which their sender (the stage after) estimates from them and sends on the
  same step clock, exactly as the forward's sender does (a `SubspaceCodec` with a `Subspace` of its own). The
  projection is passed straight through: the stage before gets the gradient of the model without it, in the
  directions the gradients take. At width 1024 the activations' rank-16 basis holds 16% of the boundary gradient's
  energy and the gradient's own 44% (benchmarks/RESULTS.md).

Error feedback (`feedback`, as PowerSGD's and Qsparse's; with the own basis only): the sender keeps what each
message left out (its input, plus what was kept before, less what the receiver decodes) by position in the message,
and adds it to the next message's same position. The sum the receiver applies over a run equals the sum sent, less
the one residual still kept; what the basis leaves out piles up until a refresh takes its directions (the moment sees
it) and then goes at once. With the activations' basis it would never go: that basis never sees the gradient.
Position, not sample: in a one-epoch fine-tune no sample comes back, so a per-sample memory would hold every
sample's residual and deliver none of it. Measured (benchmarks/RESULTS.md, widths 1024 and 2048): neither the own
basis nor feedback beats the activations' basis, whose backward is the gradient of the model the pipeline runs.

A refresh takes effect at the first message of a step, when every backward of the step before has been sent and
received, so one step's forward and backward use one basis on both sides. The receiver learns which of its posted
messages carries the basis by counting as the sender does (the first message after `end_step`, in a refresh step)
and checks it by the payload's size.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .codecs import Message, _Codec, check_payload
from .fields import check_int, check_share
from .quantizer import QuantizedTensor, check_float, dequantize

BASIS_DTYPE = torch.bfloat16  # what the basis travels as; both sides use the values as decoded
BACKWARD_BASES = ("activations", "own")  # the bases a subspace backward may travel in
RANK_BYTES = 4  # the next refresh's rank, announced (auto rank) as an int32


def refresh_step(step: int) -> bool:
    """Whether the `step`th step (counted from 0, steps with a message only) sends a new basis: 0, 1, 2, 4, 8, ...,
    so a run of n steps sends log2(n) + 2 of them."""
    return step == 0 or step & (step - 1) == 0


class Subspace:
    """The basis one side of a boundary holds, and the step clock that says when it is refreshed.

    The sender also keeps the second moment of every activation it sent (width x width, on the activations'
    device), from which each refresh estimates the basis. Its rank is `rank`, or, with `energy` (a share, auto
    rank), the smallest that keeps that share of the moment's energy, at most `rank` (the first refresh's): the
    sender chooses it at the first message of the step before each refresh and sends it there (4 bytes), so both
    sides know each message's size before it is posted; it takes effect as that step ends."""

    def __init__(self, rank: int, energy: float | None = None) -> None:
        self.most = check_int("subspace_rank", rank, 1)
        self.energy = None if energy is None else check_share("subspace_energy", energy)
        self.rank = self.next_rank = self.most  # the directions now, and from the next refresh (auto rank)
        self.basis: torch.Tensor | None = None  # width x rank, float32, as both sides decoded it
        self.scales: torch.Tensor | None = None  # rank, float32: each direction's root mean square
        self.moment: torch.Tensor | None = None  # the sender's sum of x^T x, float32
        self.tokens = 0  # rows summed into `moment`
        self.steps = 0  # steps that have had a message
        self._in_step = False
        self._posted: list[tuple[bool, bool]] = []  # the receiver's: each posted message's `tick` flags, in order

    def post(self) -> tuple[bool, bool]:
        """The receiver posts the next message: its `tick` flags, kept for `take_posted`."""
        self._posted.append(self.tick())
        return self._posted[-1]

    def take_posted(self) -> tuple[bool, bool]:
        """The receiver decodes the next message: the flags `post` gave it, or, where none was posted, the clock's."""
        return self._posted.pop(0) if self._posted else self.tick()

    def coefficients(self, rows: torch.Tensor) -> torch.Tensor:
        """Rows (... x width) as whitened coefficients in the basis (... x rank)."""
        return rows @ self.basis / self.scales

    def expand(self, coefficients: torch.Tensor, what: str) -> torch.Tensor:
        """Whitened coefficients (as decoded) back to rows of the width, as both sides compute them."""
        return (coefficients * self.scales) @ self.basis_for(what).T

    def tick(self) -> tuple[bool, bool]:
        """Called once a message on each side (the sender as it encodes, the receiver as it posts the receive):
        (whether it carries a new basis, whether it carries the next refresh's rank); both only on a step's first
        message, the basis in steps 0, 1, 2, 4, 8, ..., the rank (auto rank) in the step before each of those."""
        if self._in_step:
            return False, False
        self._in_step, step = True, self.steps
        self.steps += 1
        return refresh_step(step), self.energy is not None and refresh_step(step + 1)

    def end_step(self) -> None:
        """The step is over: the next message is the first of a step, at the rank announced for it."""
        self._in_step = False
        if self.energy is not None and refresh_step(self.steps):
            self.rank = self.next_rank

    def head_nbytes(self, flags: tuple[bool, bool], width: int) -> int:
        """The bytes a message carries before its coefficients, by its `tick` flags."""
        return (self.basis_nbytes(width) if flags[0] else 0) + (RANK_BYTES if flags[1] else 0)

    def send_head(self, flags: tuple[bool, bool]) -> torch.Tensor | None:
        """The sender's head for a message with these `tick` flags, after `observe`: the next rank (chosen now from
        the moment so far), then a new basis (adopted here as the receiver will). None where there is neither."""
        parts = []
        if flags[1]:
            self.next_rank = self.choose()
            parts.append(torch.tensor([self.next_rank], dtype=torch.int32, device=self.moment.device).view(torch.uint8))
        if flags[0]:
            parts.append(self.refresh())
        return torch.cat(parts) if parts else None

    def take_head(self, payload: torch.Tensor, flags: tuple[bool, bool], width: int) -> int:
        """The receiver's: take a message's head (`send_head`'s) from the start of `payload`; its bytes."""
        at = 0
        if flags[1]:
            self.next_rank = int(payload[:RANK_BYTES].clone().view(torch.int32)[0])
            if not 1 <= self.next_rank <= self.most:
                raise ValueError(f"a subspace rank of {self.next_rank} arrived: expected 1 to {self.most} (the sides' "
                                 "step clocks differ)")
            at = RANK_BYTES
        if flags[0]:
            self.adopt(payload[at:at + self.basis_nbytes(width)], width)
            at += self.basis_nbytes(width)
        return at

    def choose(self) -> int:
        """The smallest rank whose directions keep `energy` of the moment's energy, at most the bound."""
        values = torch.linalg.eigvalsh(self.moment.double()).flip(0).clamp_min(0)
        total = float(values.sum())
        if total <= 0:
            return self.most
        short = int((values.cumsum(0) < self.energy * total).sum())  # leading directions still short of the share
        return max(1, min(self.most, short + 1))

    def check_width(self, width: int) -> None:
        if self.most > width:
            raise ValueError(f"subspace_rank={self.most}: expected at most the boundary's width, {width}")
        if self.basis is not None and self.basis.shape[0] != width:
            raise ValueError(f"a subspace basis of width {self.basis.shape[0]} cannot code activations of width "
                             f"{width}")

    def follow(self, device: torch.device) -> None:
        """Hold the basis, scales and moment on `device`, where the messages are (a checkpoint loads them on the
        host)."""
        for name in ("basis", "scales", "moment"):
            value = getattr(self, name)
            if value is not None and value.device != device:
                setattr(self, name, value.to(device))

    def observe(self, rows: torch.Tensor) -> None:
        """Add a message's rows (tokens x width, float32) to the sender's second moment."""
        moment = rows.T @ rows
        self.moment = moment if self.moment is None else self.moment + moment
        self.tokens += rows.shape[0]

    def basis_nbytes(self, width: int) -> int:
        return width * self.rank * BASIS_DTYPE.itemsize + self.rank * 4

    def refresh(self) -> torch.Tensor:
        """The sender's new basis from its moment so far, adopted as the receiver will decode it; its bytes."""
        values, vectors = torch.linalg.eigh(self.moment.double())
        top = values.argsort(descending=True)[:self.rank]
        scales = (values[top].clamp_min(0) / max(self.tokens, 1)).sqrt().clamp_min(1e-12).float()
        basis = vectors[:, top].to(BASIS_DTYPE).contiguous()
        payload = torch.cat([basis.reshape(-1).view(torch.uint8), scales.view(torch.uint8)])
        self.adopt(payload, self.moment.shape[0])
        return payload

    def adopt(self, payload: torch.Tensor, width: int) -> None:
        """Take the basis a refresh's `payload` carries (both sides call it on the same bytes)."""
        cut = width * self.rank * BASIS_DTYPE.itemsize
        self.basis = payload[:cut].clone().view(BASIS_DTYPE).view(width, self.rank).float()
        self.scales = payload[cut:].clone().view(torch.float32)

    def basis_for(self, what: str) -> torch.Tensor:
        if self.basis is None:
            raise RuntimeError(f"{what} before the subspace's first basis arrived: the sides' step clocks differ")
        return self.basis

    def state_dict(self) -> dict[str, Any]:
        return {"rank": self.most, "energy": self.energy, "now": self.rank, "next": self.next_rank,
                "basis": self.basis, "scales": self.scales, "moment": self.moment, "tokens": self.tokens,
                "steps": self.steps}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["rank"] != self.most or state.get("energy") != self.energy:
            raise ValueError(f"subspace state has rank {state['rank']} (energy {state.get('energy')}), this codec "
                             f"{self.most} (energy {self.energy}): subspace_rank and subspace_energy must match")
        self.basis, self.scales, self.moment = state["basis"], state["scales"], state["moment"]
        self.tokens, self.steps, self._in_step = int(state["tokens"]), int(state["steps"]), False
        self.rank, self.next_rank = int(state.get("now", self.most)), int(state.get("next", self.most))


class _SubspaceCodec(_Codec):
    """What both directions share: k coefficients a token, quantized per token (or per `group_size`)."""

    modes = ("subspace",)
    buffer = None  # no per-sample rows

    def __init__(self, subspace: Subspace, bits: int, *, stochastic: bool = True, seed: int = 0,
                 group_size: int | None = None, scale_dtype: torch.dtype = torch.float32,
                 feedback: bool = False) -> None:
        super().__init__("subspace", bits, stochastic, seed, group_size, scale_dtype=scale_dtype)
        self.subspace = subspace
        self.feedback = feedback
        self.residual: torch.Tensor | None = None  # the sender's, with feedback: what its messages left out (float32)
        self._snapshot = False  # a rejected step's restore of the residual is taken this step

    def _fed(self, x: torch.Tensor) -> torch.Tensor:
        """x as float32, plus (with feedback) what earlier messages left out at its positions."""
        x = x.detach().float()
        if not self.feedback or self.residual is None:
            return x
        self._cover(x)
        return x + self.residual[_region(x.shape)]

    def _keep_rest(self, fed: torch.Tensor, decoded: torch.Tensor) -> None:
        """With feedback: what the receiver will not apply of `fed` (it applies `decoded`), kept for the next
        message at the same positions."""
        if self.feedback:
            self._cover(fed)
            self.residual[_region(fed.shape)] = fed - decoded.float()

    def _cover(self, x: torch.Tensor) -> None:
        """The residual grown (with zeros) to hold a message of x's shape; what lies beyond it waits for a larger
        message."""
        if self.residual is not None and self.residual.device != x.device:  # a checkpoint loads it on the host
            self.residual = self.residual.to(x.device)
        r = self.residual
        if r is not None and (r.dim() != x.dim() or r.shape[-1] != x.shape[-1]):
            raise ValueError(f"a message of shape {tuple(x.shape)} after ones of shape {tuple(r.shape)}: error "
                             "feedback needs messages of one width and as many dimensions")
        shape = x.shape if r is None else torch.Size(max(a, b) for a, b in zip(r.shape, x.shape))
        if r is None or r.shape != shape:
            grown = torch.zeros(shape, dtype=torch.float32, device=x.device)
            if r is not None:
                grown[_region(r.shape)] = r.to(x.device)
            self.residual = grown

    def _coefficients_nbytes(self, shape: torch.Size) -> int:
        return QuantizedTensor.wire_nbytes(torch.Size((*shape[:-1], self.subspace.rank)), self.bits,
                                           self.group_size, self.scale_dtype)

    def _quantized(self, coefficients: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.quantize(coefficients)
        return q.to_bytes(), dequantize(q)

    def _dequantized(self, payload: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        coefficients = torch.Size((*shape[:-1], self.subspace.rank))
        return dequantize(QuantizedTensor.from_bytes(payload, coefficients, torch.float32, self.bits, self.group_size,
                                                     self.scale_dtype))

    def config(self) -> dict[str, Any]:
        return {**super().config(), "rank": self.subspace.most, "feedback": self.feedback,
                **({"energy": self.subspace.energy} if self.subspace.energy is not None else {})}

    def end_step(self) -> None:
        """A step ended: the next forward message is the first of a step (a refresh's, if the step clock says)."""
        self.subspace.end_step()
        self._snapshot = False

    def take_change(self) -> tuple[float, float]:
        return 0.0, 0.0

    def undo_point(self, sample_ids: Any) -> Callable[[], None]:
        """What puts back the sender's residual (with feedback) as it is now. A refresh both sides took stays
        taken."""
        if not self.feedback or self._snapshot:  # the step's first snapshot is the one a rejected step needs
            return lambda: None
        kept, self._snapshot = None if self.residual is None else self.residual.clone(), True

        def restore() -> None:
            self.residual, self._snapshot = kept, False
        return restore

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **({"residual": self.residual} if self.feedback else {})}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        if self.feedback:
            self.residual = state["residual"]


def _region(shape: torch.Size) -> tuple[slice, ...]:
    return tuple(slice(0, n) for n in shape)


class SubspaceCodec(_SubspaceCodec):
    """A boundary's activations as whitened coefficients in the shared basis (the forward direction)."""

    def encode(self, x: torch.Tensor, sample_ids: Any = None, *, refresh: bool = False) -> Message:
        check_float(x)
        self.check_input(x, "SubspaceCodec input")
        s, width = self.subspace, x.shape[-1]
        s.check_width(width)
        s.follow(x.device)
        fed = self._fed(x)
        rows = fed.reshape(-1, width)
        s.observe(rows)
        head = s.send_head(s.tick())
        codes, values = self._quantized(s.coefficients(rows).view(*x.shape[:-1], s.rank))
        decoded = s.expand(values, "an activation").to(x.dtype)
        self._keep_rest(fed, decoded)
        payload = codes if head is None else torch.cat([head.to(codes.device), codes])
        return Message(payload, x.shape, x.dtype, decoded=decoded)

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, sample_ids: Any = None,
                       *, refresh: bool = False) -> int:
        """The size the receiver posts for the next message: the coefficients, and the basis (and the next rank) where
        the step clock says this message carries one (so call it once a message, in the order they are sent)."""
        shape = torch.Size(shape)
        self.subspace.check_width(shape[-1])
        return self.subspace.head_nbytes(self.subspace.post(), shape[-1]) + self._coefficients_nbytes(shape)

    def decode(self, message: Message, sample_ids: Any = None, *, refresh: bool = False) -> torch.Tensor:
        """The activation a message carries: the next posted one (`payload_nbytes`), or, where none was posted, the
        next by the step clock."""
        s, shape = self.subspace, torch.Size(message.shape)
        flags = s.take_posted()
        body, head = self._coefficients_nbytes(shape), s.head_nbytes(flags, shape[-1])
        check_payload(message, head + body, f"for a rank-{s.rank} subspace of {tuple(shape)}" +
                      (" with its basis (a refresh)" if flags[0] else ""))
        s.follow(message.payload.device)
        s.take_head(message.payload, flags, shape[-1])
        values = self._dequantized(message.payload[head:], shape)
        return s.expand(values, "an activation").to(message.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "subspace": self.subspace.state_dict()}

    def load_state(self, state: dict[str, Any]) -> None:
        super().load_state(state)
        self.subspace.load_state_dict(state["subspace"])


class SubspaceGradCodec(_SubspaceCodec):
    """The gradient with respect to a subspace-coded activation, as its k coefficients in the same basis (the
    backward direction): g U, expanded as (g U) U^T, the exact gradient of the projected forward."""

    def encode(self, g: torch.Tensor, sample_ids: Any = None, *, refresh: bool = False) -> Message:
        check_float(g)
        self.check_input(g, "SubspaceGradCodec input")
        self.subspace.follow(g.device)
        basis = self.subspace.basis_for("a gradient")
        self.subspace.check_width(g.shape[-1])
        fed = self._fed(g)
        codes, values = self._quantized(fed @ basis)
        decoded = (values @ basis.T).to(g.dtype)
        self._keep_rest(fed, decoded)
        return Message(codes, g.shape, g.dtype, decoded=decoded)

    def payload_nbytes(self, shape: torch.Size | tuple[int, ...], dtype: torch.dtype, sample_ids: Any = None,
                       *, refresh: bool = False) -> int:
        return self._coefficients_nbytes(torch.Size(shape))

    def decode(self, message: Message, sample_ids: Any = None, *, refresh: bool = False) -> torch.Tensor:
        self.subspace.follow(message.payload.device)
        shape = torch.Size(message.shape)
        check_payload(message, self._coefficients_nbytes(shape), f"for a rank-{self.subspace.rank} subspace gradient "
                      f"of {tuple(shape)}")
        return (self._dequantized(message.payload, shape) @ self.subspace.basis_for("a gradient").T).to(message.dtype)


def subspace_codecs(rank: int, forward_bits: int, backward_bits: int | None = None, *, energy: float | None = None,
                    stochastic: bool = True,
                    seed: int = 0, backward_seed: int = 1, group_size: int | None = None,
                    backward_group_size: int | None = None, scale_dtype: torch.dtype = torch.float32,
                    backward_basis: str = "activations", feedback: bool = False
                    ) -> tuple[SubspaceCodec, SubspaceCodec | SubspaceGradCodec | None]:
    """One side of a boundary's subspace codecs at rank `rank`: the activations' at `forward_bits` and, where
    `backward_bits` is given, their gradients' (else None: the backward goes dense), in the activations' basis or
    their own (`backward_basis`: BACKWARD_BASES), with error feedback where `feedback`; `energy`: auto rank, the share
    of energy each basis keeps, `rank` its bound."""
    if backward_basis not in BACKWARD_BASES:
        raise ValueError(f"backward_basis={backward_basis!r}: expected one of {', '.join(BACKWARD_BASES)}")
    subspace = Subspace(rank, energy)
    forward = SubspaceCodec(subspace, forward_bits, stochastic=stochastic, seed=seed, group_size=group_size,
                            scale_dtype=scale_dtype)
    if feedback and backward_basis == "activations":
        raise ValueError("backward_feedback: expected backward_basis own (what the activations' basis leaves out of "
                         "a gradient never enters it, so feedback would keep it for good)")
    if backward_bits is None:
        return forward, None
    kind = SubspaceGradCodec if backward_basis == "activations" else SubspaceCodec
    return forward, kind(subspace if backward_basis == "activations" else Subspace(rank, energy), backward_bits,
                         stochastic=stochastic, seed=backward_seed, group_size=backward_group_size,
                         scale_dtype=scale_dtype, feedback=feedback)
