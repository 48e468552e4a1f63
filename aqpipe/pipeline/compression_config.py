"""What every stage boundary and tied weight sends, as one section of settings the engine takes whole."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from aqpipe.compression import (BACKWARD_BASES, BACKWARD_MODES, BUFFER_BITS, FIRST_VISIT_MODES, FORWARD_MODES,
                                SCALE_DTYPES, check_bits)
from aqpipe.compression.running_base import BASES

from .ties import TIE_MODES
from aqpipe.compression.fields import FREE, KEPT, THIS_RUN, check_choices, check_int, check_share, is_int, setting

BUFFER_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# "auto" groups: a quantizer at 2 bits or fewer takes groups of this many elements (where rows are wider),
# wider quantizers whole rows (chosen by measurement: benchmarks/RESULTS.md, "Groups for 2-bit quantizers")
AUTO_GROUP_SIZE = 64
AUTO_GROUP_BITS = 2


def _bits(name: str, value: object, needed: bool) -> None:
    if value == "auto" and name != "tie_bits":
        return
    if value is not None or needed:
        check_bits(value, name)



@dataclass(frozen=True)
class CompressionConfig:
    """Per boundary: forward none|direct|hadamard|aqsgd|subspace, backward none|direct|hadamard|subspace, full-precision
    warm-up epochs. `subspace` (compression/subspace.py): each token as `subspace_rank` coefficients in a basis the
    sender estimates and sends now and then; its backward in the same basis.

    `forward_group_size` / `backward_group_size`: elements per quantization group (its min and step
    travel as 8 bytes); None: a whole row of the last dimension; "auto": AUTO_GROUP_SIZE for a quantizer
    at AUTO_GROUP_BITS bits or fewer on rows wider than that (whose error over whole rows breaks AQ-SGD's
    c_Q bound), else rows. `stochastic`: unbiased stochastic rounding (AQ-SGD's theorem assumes
    it), else round to nearest. `tie`: how tied weights' rows and gradients travel (ties.py): `none`
    exactly, `aqsgd` as `tie_bits` changes against the follower's rows and `tie_bits` gradients;
    `auto` is `none` when both boundary codecs are and `aqsgd` otherwise.

    `forward_bits` / `backward_bits` "auto": bits per boundary priced on the schedule from its measured link
    and the stages' compute (auto_bits.py), between `auto_bits_min` and `auto_bits_max`, as many as keep the
    step within `auto_bits_slack` of its length at the fewest, decided every `auto_bits_every` steps;
    `link_mbit` (one rate per boundary, Mbit/s) replaces the measurement. It prices the packed sizes: the entropy
    stage's savings (`entropy_coding`) and its coding time are not in its sums.
    """

    forward: str = setting("none", f"activations: one of {', '.join(FORWARD_MODES)}", "forward_compress",
                           choices=FORWARD_MODES)
    forward_bits: int | str | None = setting(None, "bits of forward compression (1-8), or auto: per boundary, the most "
                                           "its link and the stages' compute make cheap")
    backward: str = setting("none", f"gradients: one of {', '.join(BACKWARD_MODES)}", "backward_compress",
                            choices=BACKWARD_MODES)
    backward_bits: int | str | None = setting(None, "bits of backward compression (1-8), or auto")
    subspace_rank: int | str = setting(32, "directions of a subspace boundary's basis (forward_compress subspace): "
                                           "each token travels as this many coefficients, and its gradient too with "
                                           "backward_compress subspace; auto: at each refresh the fewest that keep "
                                           "subspace_energy of the boundary's energy, at most subspace_max_rank",
                                       older=THIS_RUN)  # before subspace codecs: no basis
    subspace_energy: float = setting(0.99, "with subspace_rank auto: the share of the boundary's energy (the second "
                                           "moment of what was sent) the chosen rank keeps", older=0.99)
    subspace_max_rank: int = setting(64, "with subspace_rank auto: the most directions it may choose (and the first "
                                         "refresh's)", older=64)
    backward_basis: str = setting("activations", "the basis a subspace backward's gradients travel in: activations "
                                                 "(the forward's: the exact gradient of the projected forward) or own "
                                                 "(one their sender estimates from the gradients and sends on the "
                                                 "forward's clock: the projection passed straight through)",
                                  choices=BACKWARD_BASES, older="activations")
    backward_feedback: bool = setting(False, "error feedback for a subspace backward: what a message leaves out is "
                                             "added to the next message's same position, delayed, not dropped",
                                      older=False)
    first_visit: str = setting("none", "how AQ-SGD sends a sample's first visit (and a warm-up's refresh): none "
                                     "(whole, at full precision: the paper's), cache-free as direct or hadamard at "
                                     "first_visit_bits (both sides keep what was decoded), or auto: none for a "
                                     "sample the run reads back (the base of its later changes), hadamard for one it "
                                     "never does (every sample of a one-epoch run)", "first_visit_compress",
                               choices=("auto", *FIRST_VISIT_MODES), resume=KEPT, older="none")
    first_visit_bits: int | None = setting(None, "bits of a compressed first visit (1-8)", older=THIS_RUN)
    first_visit_base: str = setting("none", "a compressed first visit sent as the change from the boundary's running "
                                          "mean per position (position), or whole (none)",
                                    choices=BASES, older=THIS_RUN)  # before it: whole first visits, no base
    warmup_epochs: int = setting(0, "epochs that send every sample whole (as first visits are sent) before deltas "
                                    "start")
    buffer_dtype: torch.dtype = setting(torch.float16, f"AQ-SGD buffer dtype: one of {', '.join(BUFFER_DTYPES)}")
    buffer_bits: int | None = setting(None, "hold AQ-SGD buffer rows quantized to 4 or 8 bits (8: about half of "
                                          "float16's memory; default: rows in buffer_dtype)", older=None)
    buffer_dir: str | None = setting(None, "keep AQ-SGD buffers in files under this directory instead of RAM (one "
                                         "file per boundary side); none: in memory where the rows fit "
                                         "--buffer_memory_gb, else in files under <output_dir>/buffers",
                                   resume=FREE)  # where the buffers' rows live, and how many samples keep one
    buffer_memory_gb: float | None = setting(None, "AQ-SGD buffer rows a rank may hold in memory, GB; none: half "
                                                 "the memory available at start, shared by the machine's ranks",
                                           resume=FREE)
    buffer_disk_gb: float | None = setting(None, "AQ-SGD buffer rows a rank may hold on disk when they do not fit in "
                                               "memory, GB; none: half the free space where they go, shared by "
                                               "the machine's ranks. What fits neither keeps rows for as many "
                                               "samples as the larger holds, the others sent whole at every visit",
                                         resume=FREE)  # a run that keeps fewer sends more whole
    forward_group_size: int | str | None = setting("auto", "the forward quantizer's group: N elements (each group's "
                                                 "min and step: 8 bytes, 4 with bfloat16 scales), auto (64 at 2 "
                                                 "bits or fewer, else rows) or none (whole rows)")
    backward_group_size: int | str | None = setting("auto", "the backward quantizer's group: N, auto or none")
    stochastic: bool = setting(True, "stochastic rounding in every quantizer (unbiased; the default); "
                                   "--no_stochastic rounds to nearest (biased; outside AQ-SGD's theorem)")
    scale_dtype: str = setting("float32", "what each boundary and tied-weight quantization group's min and step "
                                          "travel as: float32 (8 bytes a group) or bfloat16 (4: the min rounded "
                                          "down, the step up, so rounding stays unbiased)",
                           choices=SCALE_DTYPES, older="float32")
    entropy_coding: bool = setting(True, "Huffman-code each compressing codec's messages over a gloo link (lossless; "
                                       "11-15%% fewer bytes at 2-4 bits for about 13 ns a byte, both sides: it pays "
                                       "below about 70 Mbit/s); --no_entropy_coding sends the packed codes",
                                   resume=FREE)  # lossless: the same values cross either way
    tie: str = setting("auto", f"tied weights (an embedding and its LM head): auto, {', '.join(TIE_MODES)} (auto: "
                             "none when both boundary codecs are none, else aqsgd)", "tie_compress",
                       choices=("auto", *TIE_MODES))
    tie_bits: int = setting(8, "bits of tied-weight rows (as changes) and their gradients with tie_compress aqsgd")
    tie_rank: int = setting(0, "tied-weight gradients as this many coefficients a row in a basis their sender "
                               "estimates and sends now and then (as a subspace boundary's); 0: every value of a row",
                         older=0)
    tie_rows_rank: int = setting(0, "tied-weight rows' changes as this many coefficients a row in a basis the owner "
                                    "estimates from them and sends now and then; what it leaves out goes with the "
                                    "row's next change. 0: every value of a row", older=0)
    auto_bits_min: int = setting(2, "the fewest bits auto may choose")
    auto_bits_max: int = setting(8, "the most bits auto may choose")
    auto_bits_every: int = setting(20, "steps between auto's decisions, each after probing the links")
    auto_bits_slack: float = setting(0.02, "how much longer than at the fewest bits auto may make a step to send "
                                         "more bits, a fraction", older=0.02)
    link_mbit: list[float] | None = setting(None, "known link rates, Mbit/s, one per boundary (comma-separated): "
                                                "auto decides from them instead of probing", older=None)

    def __post_init__(self) -> None:
        """Every value against its range as the section is made, one line naming the setting as its flag does; no
        I/O."""
        check_choices(self)
        if self.backward == "subspace" and self.forward != "subspace":
            raise ValueError(f"backward_compress=subspace: expected forward_compress subspace too (the gradient "
                             f"travels in the forward's basis), got {self.forward!r}")
        for name in ("stochastic", "entropy_coding", "backward_feedback"):  # switches first: others read them
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r}: expected true or false")
        for name, changed in (("backward_basis", self.backward_basis != "activations"),
                              ("backward_feedback", self.backward_feedback)):
            if changed and self.backward != "subspace":
                raise ValueError(f"{name}={getattr(self, name)!r}: expected backward_compress subspace (it shapes a "
                                 f"subspace backward), got {self.backward!r}")
        if self.backward_feedback and self.backward_basis != "own":
            raise ValueError("backward_feedback=True: expected backward_basis own (what the activations' basis leaves "
                             "out of a gradient never enters it, so feedback would keep it for good)")
        if self.forward == "subspace":
            if self.subspace_rank == "auto":
                check_int("subspace_max_rank", self.subspace_max_rank, 1)
                check_share("subspace_energy", self.subspace_energy)
            else:
                check_int("subspace_rank", self.subspace_rank, 1, what="a positive number of directions, or auto")
            for direction in ("forward", "backward"):
                if getattr(self, direction) == "subspace" and getattr(self, f"{direction}_bits") == "auto":
                    raise ValueError(f"{direction}_bits=auto: a subspace codec takes fixed bits (1-8)")
        if self.first_visit_bits is not None or self.first_visits_compressed():
            check_bits(self.first_visit_bits, "first_visit_bits")
        _bits("forward_bits", self.forward_bits, self.forward != "none")
        _bits("backward_bits", self.backward_bits, self.backward != "none")
        _bits("tie_bits", self.tie_bits, self.tie_mode() != "none")
        for name in ("forward_group_size", "backward_group_size"):
            value = getattr(self, name)
            if value not in (None, "auto") and (not is_int(value) or value < 1):
                raise ValueError(f"{name}={value!r}: expected a positive integer, auto, or none for whole rows")
        check_int("warmup_epochs", self.warmup_epochs, 0)
        check_int("tie_rank", self.tie_rank, 0)
        check_int("tie_rows_rank", self.tie_rows_rank, 0)
        if self.buffer_dtype not in BUFFER_DTYPES.values():
            name = str(self.buffer_dtype).removeprefix("torch.")
            raise ValueError(f"buffer_dtype={name!r}: expected one of {', '.join(BUFFER_DTYPES)}")
        if self.auto():
            for name in ("auto_bits_min", "auto_bits_max"):
                check_bits(getattr(self, name), name)
            if self.auto_bits_min > self.auto_bits_max:
                raise ValueError(f"auto_bits_min={self.auto_bits_min} > auto_bits_max={self.auto_bits_max}: "
                                 "expected min <= max")
            slack = self.auto_bits_slack
            if isinstance(slack, bool) or not isinstance(slack, (int, float)) or not 0 <= slack <= 1:
                raise ValueError(f"auto_bits_slack={slack!r}: expected a fraction in [0, 1]")
            every = self.auto_bits_every
            check_int("auto_bits_every", every, 1, what="a positive number of steps")
        if self.link_mbit is not None and (not isinstance(self.link_mbit, (list, tuple)) or not all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 for v in self.link_mbit)):
            raise ValueError(f"link_mbit={self.link_mbit!r}: expected positive rates in Mbit/s, one per boundary")
        for name in ("buffer_memory_gb", "buffer_disk_gb"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not 0 <= value < float("inf")):
                raise ValueError(f"{name}={value!r}: expected a size in GB >= 0, or none for the default")
        if self.buffer_bits is not None and self.buffer_bits not in BUFFER_BITS:
            raise ValueError(f"buffer_bits={self.buffer_bits!r}: expected one of {', '.join(map(str, BUFFER_BITS))}, "
                             "or none for rows in buffer_dtype")

    def subspace(self) -> tuple[int, float | None]:
        """A subspace boundary's rank, or with auto rank its bound, and the energy share auto keeps (None: fixed)."""
        if self.subspace_rank == "auto":
            return self.subspace_max_rank, float(self.subspace_energy)
        return self.subspace_rank, None

    def whole_rows(self) -> tuple[str, str]:
        """How AQ-SGD's whole rows travel: (first visits of samples the buffers keep, rows of samples they keep out).
        `auto`: a kept sample's first visit is the base of every later change, so it goes at full precision; a row
        never read back buys no later change, so it goes cache-free at 3-bit Hadamard, as a one-epoch run's every
        row (benchmarks/RESULTS.md, "Compressed from the first step" and "AQ-SGD at a user's dataset size")."""
        return ("none", "hadamard") if self.first_visit == "auto" else (self.first_visit, self.first_visit)

    def scales(self) -> torch.dtype:
        """The dtype quantization groups' scales travel as."""
        return SCALE_DTYPES[self.scale_dtype]

    def first_visits_compressed(self) -> bool:
        """Whether AQ-SGD's whole rows travel through a cache-free codec (only AQ-SGD has first visits)."""
        return self.forward == "aqsgd" and self.first_visit != "none"

    def auto(self, direction: str | None = None) -> bool:
        """Whether `direction`'s bits (either's, for None) are chosen per link."""
        directions = (direction,) if direction else ("forward", "backward")
        return any(getattr(self, d) != "none" and getattr(self, f"{d}_bits") == "auto" for d in directions)

    def group_size(self, direction: str, width: int, bits: int | None = None) -> int | None:
        """The group the `direction` ("forward" or "backward") quantizer uses on rows of `width` at `bits` (default:
        its configured bits), auto resolved."""
        value = getattr(self, f"{direction}_group_size")
        bits = getattr(self, f"{direction}_bits") if bits is None else bits
        if value == "auto":
            small = bits is not None and bits <= AUTO_GROUP_BITS and width > AUTO_GROUP_SIZE
            return AUTO_GROUP_SIZE if small else None
        return value

    def tie_mode(self) -> str:
        if self.tie == "auto":
            return "none" if self.forward == "none" and self.backward == "none" else "aqsgd"
        return self.tie
