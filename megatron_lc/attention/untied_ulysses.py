"""Untied Ulysses (UPipe): Ulysses context parallelism run over the heads in stages.

Ulysses exchanges all H heads at once, so every Q/K/V/O-shaped buffer around attention
holds H/cp heads of the full sequence. Untied Ulysses runs the same computation in
stages of U heads (U a multiple of cp, so U/cp heads per rank per stage): the op takes
the normed local hidden states and the raw q/k/v weights, and per stage projects only
that stage's heads, applies rotary, exchanges them (sequence-sharded -> head-sharded),
runs local attention, exchanges the output back and writes it into one preallocated
output. Full Q, K and V never exist; the stage buffers are the same every stage.

Head ordering. As in Ulysses, rank r owns q heads [r*H/cp, (r+1)*H/cp) and the kv heads
they attend with (kv heads replicated first when there are fewer than cp of them).
Stage j sends to every rank r the j-th block of U/cp heads of its own range, so every
rank's q heads of a stage belong to kv heads the same rank holds, and the output of
stage j returns to head slots [r*H/cp + j*U/cp, ...) of every r: the natural order
`o_proj` expects. Each rank's kv heads are exchanged in rounds; a round's kv heads serve
all the stages whose q heads use them (one exchange per GQA group), which requires U/cp
to divide, or be a multiple of, the number of q heads per (replicated) kv head.

Backward saves only x, the weights, the output and each stage's log-sum-exp. In the recompute of a
block that keeps its attention (its store passed as `kept`, `memory/kept_attention.py`), the op takes the
output and the lses its forward kept and runs no stage: no projection, exchange or kernel of the forward again. Per stage
it recomputes the projections, rotary and the exchange of q (k and v once per round),
exchanges the stage's output and output-gradient slices, calls the kernel's backward
(no attention-forward recompute), sums dK/dV over the round (or, with `backward_memory="lean"`,
sends each stage's back with its dQ and frees each stage's output once sent), exchanges the gradients back and accumulates dx and
the rows of dWq/dWk/dWv in place.

Precision (16-bit inputs): the dK/dV sums of a kv round are kept in fp32 and cast once,
when they are sent back (lean: each stage's 16-bit dK/dV, as the kernel
made them, are summed in fp32 by the projections instead); the weight-gradient rows are
summed over ranks and samples by GEMMs writing fp32 and each row is written once; dx is
summed over ranks, samples and a stage's exchanges in fp32, a row chunk at a time, and
rounded once per backward stage (see `_add_to_dx` for why not once in all).

Buffers: what a stage receives lands in buffers of a `StageWorkspace` owned by the
backend object and reused across stages, layers and steps; it is the only state. Send
buffers are transient (freed before the attention kernels run, so they never add to the
peak). Blocks that travel at the same time share one all-to-all, so a forward stage costs
one exchange each way; a backward stage sends its output and output gradient in two
exchanges of their own (the kernels want their rows contiguous, see `_send_backward_inputs`).

Exchanges are synchronous by default. With `overlap` (`--untied-overlap-stages`) the stages
are pipelined: in forward the next stage's projections and exchange are in flight while a
stage attends; in backward the next stage's q, o and do, and the previous stage's gradients
on their way back, are in flight while a stage's kernel runs. That costs a second set of
stage buffers (a third receive buffer for q in backward) and keeps the send buffers of
exchanges in flight alive through the kernel: the planner traces both. The arithmetic and
its order are the same either way, so the results are bit for bit the same.

The stage plan (`untied_plan.py`), the stage buffers (`untied_workspace.py`), the input norm folded into the
projections (`untied_norm.py`) and the autograd function (`untied_function.py`) have modules of their own.
"""

from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from megatron_lc.attention.kernels import Kernel
from megatron_lc.attention.untied_function import OutputGradient, UntiedUlyssesFunction
from megatron_lc.attention.untied_norm import DX_CHUNK_ROWS, InputNorm
from megatron_lc.attention.untied_plan import BackwardMemory, StagePlan
from megatron_lc.attention.untied_workspace import StageWorkspace
from megatron_lc.memory import tiling
from megatron_lc.memory.kept_attention import KeptTensor
from megatron_lc.memory.tiling import RankLoop, TileBounds, addmm_fp32_, every_rank


# --- rotary, in place ----------------------------------------------------------------------


def _rotate_(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> None:
    """Rotate t [..., d] in place (rotate-half convention); `inverse` applies the transpose.

    cos/sin broadcast against t. Forward: y1 = x1 c1 - x2 s1, y2 = x2 c2 + x1 s2. The
    transpose (the gradient map): x1 = y1 c1 + y2 s2, x2 = y2 c2 - y1 s1.
    """
    _rotate_halves_(t, _halves(cos, sin), inverse)


def _halves(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(c1, c2, s1, s2): the first and second halves of cos and sin [..., d] (views, taken once per pass)."""
    h = cos.shape[-1] // 2
    return cos[..., :h], cos[..., h:], sin[..., :h], sin[..., h:]


def _rotate_halves_(t: torch.Tensor, halves: tuple[torch.Tensor, ...], inverse: bool = False) -> None:
    """`_rotate_` with cos and sin given as `_halves`."""
    h = t.shape[-1] // 2
    t1, t2 = t[..., :h], t[..., h:]
    c1, c2, s1, s2 = halves
    first = t1.clone()  # half-size temporary: t1 is overwritten before t2 needs it
    if inverse:
        t1.mul_(c1).addcmul_(t2, s2)
        t2.mul_(c2).addcmul_(first, s1, value=-1)
    else:
        t1.mul_(c1).addcmul_(t2, s1, value=-1)
        t2.mul_(c2).addcmul_(first, s2)


# --- the op --------------------------------------------------------------------------------


@dataclass
class _PassIO:
    """One forward or backward pass of the op: its inputs viewed per sample, and the outputs it fills in."""

    x: torch.Tensor  # [B, s, hidden]
    cos: torch.Tensor  # [B, 1, s, 1, d]: broadcasts over [B, cp, s, heads, d]
    sin: torch.Tensor
    cu_seqlens: tuple
    out: object  # [B, s, H*d], or a list of each stage's [B, s, cp, U/cp, d]; written in forward, read in backward
    lses: list  # per stage (lse [U/cp, B*S], *kernel state), appended in forward, read in backward
    dout: OutputGradient | None = None
    dx: torch.Tensor | None = None
    norm: InputNorm | None = None  # x is the block input, normed on the fly by every projection

    @functools.cached_property
    def rotary(self) -> tuple[torch.Tensor, ...]:
        """`_halves(cos, sin)`, taken once per pass."""
        return _halves(self.cos, self.sin)

    @property
    def batch(self) -> int:
        return self.x.shape[0]

    @property
    def local_len(self) -> int:
        return self.x.shape[1]


@dataclass
class _HeadBlock:
    """One block of heads in an exchange; `width` = heads * d columns per token and rank.

    A block is built in one of three ways:
    - projected from x: `rows` [cp, width, hidden] are the weight rows destined to each
      rank, `grad_rows` [cp / replicas, width, hidden] the matching rows of the weight's
      gradient (None when not needed), each shared by `replicas` consecutive ranks;
    - a `piece` [B, s, cp, heads, d] of a sequence-sharded tensor (the output or its
      gradient), rank r getting piece[:, :, r];
    - a `full` [B*S, heads, d] tensor over the full sequence, sent back to the ranks
      that own its tokens (the attention output, the attention gradients).
    The first two arrive as full-sequence heads; a `full` block arrives as this rank's
    tokens of every source rank's heads.
    """

    width: int
    rows: torch.Tensor | None = None
    grad_rows: torch.Tensor | None = None
    replicas: int = 1
    rotary: bool = False
    piece: torch.Tensor | None = None
    full: torch.Tensor | None = None


@dataclass
class _InFlight:
    """An all-to-all started and not yet waited for (already done when the backend does not overlap)."""

    recv: torch.Tensor  # [B, cp, s, columns]
    works: list
    send: torch.Tensor | None  # what is being sent: referenced until the exchange completes

    def wait(self) -> torch.Tensor:
        for work in self.works:
            work.wait()
        self.works, self.send = [], None
        return self.recv


@dataclass
class _HeadExchange:
    """An exchange of blocks of heads, started. Only what the receiver needs is kept: the projected blocks
    (their weight rows, for the gradients' way back) and the column range of every block; the tensors
    that were packed are freed once sent."""

    heads: list  # the projected blocks (_HeadBlock), first in the exchange
    columns: list  # column slice of every block, projected first
    exchange: _InFlight
    kv: _HeadExchange | None = None  # the round's k and v, in an exchange of their own started just before
    carried: tuple = ()  # forward: the stages whose outputs travel after the heads


@dataclass
class _BackwardExchanges:
    """The exchanges one backward stage needs: q (maybe with k, v), its output, its output gradient."""

    q: _HeadExchange
    o: _HeadExchange
    do: _HeadExchange


@dataclass
class _Weights:
    """The q/k/v weights and their gradient buffers (None where not needed)."""

    wq: torch.Tensor
    dwq: torch.Tensor | None
    wk: torch.Tensor
    dwk: torch.Tensor | None
    wv: torch.Tensor
    dwv: torch.Tensor | None


@dataclass
class UntiedUlyssesAttention:
    """The `untied_ulysses` backend: Ulysses attention in stages of `plan.heads_per_stage` heads.

    Exchanges pack several blocks of heads into one all-to-all, in the layout
    [B, cp, s, columns]: sent, index 1 is the destination rank; received, the source
    rank. One all-to-all per sample keeps both sides contiguous. Packing saves
    collectives: in forward, the output of stage j travels with the q of stage j+1;
    when a kv round has one stage, its k and v travel with the stage's q (in backward,
    dk, dv return with dq); otherwise k and v travel once per round and their gradients
    return once, summed. In backward the stage's output and its gradient travel in two
    exchanges of their own.

    Workspace roles: `recv_stage` receives a stage's blocks (and, in backward, the
    gradients on their way back); in backward `recv_out` and `recv_dout` receive the
    stage's output and its gradient, each whole, so the kernel gets them with contiguous
    rows; `recv_kv` a round's k and v when they travel apart;
    `dk_sum`, `dv_sum` sum a round's kv gradients over its stages (with the lean backward there
    are none: `recv_out` and `recv_dout` take each stage's dk and dv back). Send buffers are
    transient, so none is held while the attention kernels run.
    """

    head_dim: int
    kernel: Kernel
    group: object
    plan: StagePlan
    overlap: bool = False
    """Pipeline the stages (`--untied-overlap-stages`): the next stage's projections and exchanges are in
    flight while this stage attends, forward and backward, in a second set of stage buffers."""
    backward_memory: BackwardMemory = "fast"
    """What the backward holds (`--untied-backward`). `fast`: a kv round's dK/dV summed over its stages in fp32
    here and sent back once, and the output kept whole. `lean`: each stage's dK/dV sent back with its dQ, in the
    buffers of its consumed output and output gradient, and summed by the projections on the tokens' ranks (no
    fp32 sums held; 2 x (stages - 1) more kv-head blocks exchanged per round), and, with `wo`, the output kept
    by stage and each stage's freed once sent (o_proj then sums the stages' GEMMs in an fp32 accumulator)."""
    workspace: StageWorkspace = field(default_factory=StageWorkspace)
    tile_bounds: TileBounds = tiling.tile_bounds
    """The tile policy of the row-chunk loops (the planner's runs representative chunks)."""
    rank_loop: RankLoop = every_rank
    """The ranks whose GEMMs the per-rank projection loops run: every one; the planner's runs two (each
    iteration writes a slice of a buffer allocated before the loop and frees its temporaries in the next, so
    two give the loop's exact peak)."""
    fp32_out_gemm: bool | None = None
    """How the fp32 sums of 16-bit products are taken (`tiling.addmm_fp32_`; the planner states its target's)."""

    @property
    def cp(self) -> int:
        return self.plan.cp

    @property
    def _kv_with_stage(self) -> bool:
        """k and v travel with the stage's q: every round has one stage."""
        return self.plan.stages_per_round == 1

    @property
    def _kv_grads_per_stage(self) -> bool:
        """The lean backward on rounds of several stages: each stage sends its dk and dv back."""
        return self.backward_memory == "lean" and not self._kv_with_stage

    @property
    def _out_period(self) -> int:
        """Buffers of the backward's output and output gradient taking turns with overlap: three when they take
        a stage's dk and dv back (they are then in use until the next stage's kernel has run)."""
        return 3 if self._kv_grads_per_stage else 2

    projects_output = True
    """Takes `o_proj`'s weight (`wo=`): its backward then never holds the whole attention-output gradient."""
    fuses_input_norm = True
    """Takes the block input and its RMSNorm (`norm_weight=`, `norm_eps=`): the normed input is never stored."""

    @property
    def output_by_stage(self) -> bool:
        """Given `wo`, the output is made and kept as its stages' heads (the lean backward frees each once sent)."""
        return self.backward_memory == "lean"

    def kept_tensors(self, batch: int, tokens: int, num_heads: int, dtype: torch.dtype) -> list[KeptTensor]:
        """What a keeping block puts on the host for `batch` samples of `tokens` local tokens (`StagePlan.kept`)."""
        return self.plan.kept(batch, tokens, self.head_dim, dtype, self.output_by_stage)

    def __call__(self, x, wq, wk, wv, cos, sin, cu_seqlens, kept=None, wo=None, norm_weight=None, norm_eps=None):
        """x [B, S/cp, hidden] (normed, or the block input with `norm_weight`), cos/sin [B, S/cp, d] ->
        pre-`o_proj` output [B, S/cp, H*d], or with `wo` the projected output [B, S/cp, hidden]. `kept`: the
        block's kept attention store (None: nothing kept)."""
        return UntiedUlyssesFunction.apply(x, wq, wk, wv, wo, norm_weight, cos, sin, tuple(cu_seqlens), norm_eps,
                                            self, kept)

    # --- forward ---

    def forward_stages(self, x, wq, wk, wv, cos, sin, cu_seqlens, norm=None, by_stage=False):
        """The output [B, S/cp, H*d] (`by_stage`: a list of each stage's heads, [B, S/cp, cp, U/cp, d] each) and
        each stage's (log-sum-exp [U/cp, B*S], *kernel state)."""
        B, s, p = x.shape[0], x.shape[1], self.plan
        out = ([x.new_empty(B, s, self.cp, p.stage_heads_per_rank, self.head_dim) for _ in range(p.num_stages)]
               if by_stage else x.new_empty(B, s, p.num_heads * self.head_dim))
        io = self._begin(x, cos, sin, cu_seqlens, out, [], norm)
        weights = _Weights(wq, None, wk, None, wv, None)
        pending: list = []  # (output, stage) of stages attended whose output is not yet sent back
        sent, k, v = None, None, None
        for stage in range(self.plan.num_stages):
            sent = sent or self._send_stage_inputs(io, weights, stage, pending)
            q, round_k, round_v = self._receive_stage_inputs(io, sent)
            k, v = (round_k, round_v) if round_k is not None else (k, v)
            sent = None
            if self.overlap and stage + 1 < self.plan.num_stages:  # in flight while this stage attends
                sent = self._send_stage_inputs(io, weights, stage + 1, pending)
            o, lse, state = self.kernel.forward(q, k, v, cu_seqlens)
            io.lses.append((lse, *state))
            pending.append((o, stage))
            del q, o
        self._receive_stage_inputs(io, self._send_with_outputs(io, [], pending, self._role("recv_stage", 0)))
        self.workspace.release()
        return out, io.lses

    def _send_stage_inputs(self, io: _PassIO, weights: _Weights, stage: int, pending: list) -> _HeadExchange:
        """Start the exchange of a forward stage's q (with its round's k and v when they travel with it, or
        in an exchange of their own just before it when the stage opens a round) together with the
        `pending` outputs, which it empties."""
        heads, kv_sent = self._stage_heads(io, weights, stage)
        return self._send_with_outputs(io, heads, pending, self._role("recv_stage", stage), kv_sent)

    def _stage_heads(self, io: _PassIO, weights: _Weights, stage: int) -> tuple[list[_HeadBlock], _HeadExchange | None]:
        """A stage's q heads (after its round's k and v when they travel with it), and when the stage opens
        a round whose k and v travel apart, their exchange, started here."""
        kv_round = stage // self.plan.stages_per_round
        kv = [self._k_heads(weights.wk, weights.dwk, kv_round), self._v_heads(weights.wv, weights.dwv, kv_round)]
        kv_sent = None
        if not self._kv_with_stage and stage == self.plan.stages(kv_round)[0]:
            kv_sent = self._send(io, kv, self._role("recv_kv", kv_round))
        return [*(kv if self._kv_with_stage else []), self._q_heads(weights.wq, weights.dwq, stage)], kv_sent

    def _send_with_outputs(self, io: _PassIO, heads: list[_HeadBlock], pending: list, role: str,
                           kv_sent: _HeadExchange | None = None) -> _HeadExchange:
        """Start exchanging `heads` and the `pending` (output, stage) pairs, which it empties."""
        outputs = [_HeadBlock(o.shape[1] * self.head_dim, full=o) for o, _ in pending]
        carried = tuple(stage for _, stage in pending)
        pending.clear()  # the send buffer holds the outputs now
        return self._send(io, [*heads, *outputs], role, heads=heads, kv_sent=kv_sent, carried=carried)

    def _send(self, io: _PassIO, blocks: list[_HeadBlock], role: str, *, heads: list[_HeadBlock] | None = None,
              kv_sent: _HeadExchange | None = None, carried: tuple = ()) -> _HeadExchange:
        """Start exchanging `blocks`; the `_HeadExchange` keeps `heads` (default: `blocks`), not the packed tensors."""
        return _HeadExchange(blocks if heads is None else heads, self._columns(blocks),
                     self._start_all_to_all(io, blocks, role), kv_sent, carried)

    def _receive_stage_inputs(self, io: _PassIO, sent: _HeadExchange):
        """Wait for `sent` and write the outputs it carried back into `io.out`. Returns the stage's q and
        its round's k, v when they came with it (else None), over the full sequence."""
        k_v = [self._full_sequence(t) for t in self._receive(sent.kv)] if sent.kv is not None else [None, None]
        received = self._receive(sent)
        n = len(sent.heads)
        for stage, back in zip(sent.carried, received[n:]):  # this rank's tokens, every source rank's heads
            self._stage_output(io.out, stage).copy_(back.unflatten(-1, (-1, self.head_dim)).transpose(1, 2))
        heads = [self._full_sequence(t) for t in received[:n]]
        if self._kv_with_stage and heads:
            k_v = heads[:2]
        return (heads[-1] if heads else None), *k_v

    def _receive(self, sent: _HeadExchange) -> list[torch.Tensor]:
        """Wait for `sent`; each of its blocks as a view [B, cp, s, width] (index 1: the source rank)."""
        recv = sent.exchange.wait()
        return [recv[..., cols] for cols in sent.columns]

    def _role(self, name: str, index: int, period: int = 2) -> str:
        """The workspace role of stage or round `index`: with overlap `period` of them take turns, so the
        next one's exchange lands while this one's buffer is in use."""
        return f"{name}{index % period}" if self.overlap else name

    # --- backward ---

    def backward_stages(self, dout: OutputGradient, x, wq, wk, wv, cos, sin, out, lses, cu_seqlens, needs,
                        norm=None):
        """dx (with `norm`: of the normed input), dWq, dWk, dWv (None where not needed), each one buffer
        filled stage by stage."""
        io = self._begin(x, cos, sin, cu_seqlens, out, lses, norm)
        io.dout = dout
        io.dx, dwq, dwk, dwv = (torch.zeros_like(t) if need else None for t, need in zip((x, wq, wk, wv), needs))
        if self._kv_grads_per_stage:
            # Every stage writes its round's kv rows: summed in fp32 (a weight's size) and rounded once, at the end.
            dwk, dwv = (None if g is None else torch.zeros_like(g, dtype=torch.promote_types(g.dtype, torch.float32))
                        for g in (dwk, dwv))
        weights = _Weights(wq, dwq, wk, dwk, wv, dwv)
        sent, k, v, round_kv, sums = None, None, None, None, None
        returning: list[_HeadExchange] = []  # gradients on their way back (with overlap: while the next kernel runs)
        for stage in range(self.plan.num_stages):
            sent = sent or self._send_backward_inputs(io, weights, stage)
            q, o, do, got_k, got_v = self._receive_backward_inputs(sent)
            if got_k is not None:
                k, v = got_k, got_v
            if sent.q.kv is not None:
                round_kv = sent.q.kv.heads
            blocks = sent.q.heads
            sent = None
            if self.overlap and stage + 1 < self.plan.num_stages:  # in flight while this stage's kernel runs
                sent = self._send_backward_inputs(io, weights, stage + 1)
            lse, *state = io.lses[stage]
            dq, dk, dv = self.kernel.backward(do, q, k, v, o, lse, io.cu_seqlens, state=tuple(state))
            del q, o, do
            self._finish_grads(io, returning)  # the previous stage's, in the order they were sent
            stage_kv = []
            if self._kv_with_stage:
                grads = [dk, dv, dq]
            elif self._kv_grads_per_stage:
                grads, stage_kv = [dq], [dk, dv]
            else:
                sums, grads = self._sum_kv_grads(sums, dk, dv), [dq]
            del dq, dk, dv  # `grads` and `stage_kv` hold the kernel's gradients until they are sent
            # The received blocks are consumed: their buffer takes the gradients (with overlap, one of three:
            # this stage's gradients arrive while the next stage attends and the one after arrives).
            returning.append(self._send_grads(io, blocks, grads, self._role("recv_stage", stage, period=3)))
            for head, role in zip(round_kv if stage_kv else (), ("recv_out", "recv_dout")):
                # dk into the consumed output's buffer, dv into the output gradient's; each freed once sent
                returning.append(self._send_grads(io, [head], [stage_kv.pop(0)],
                                                  self._role(role, stage, self._out_period)))
            kv_round = stage // self.plan.stages_per_round
            if sums is not None and stage == self.plan.stages(kv_round)[-1]:
                k = v = None  # consumed: their buffer takes dk, dv, summed over the round and sent back once
                returning.append(self._send_grads(io, round_kv, list(sums), self._role("recv_kv", kv_round)))
                sums = None
            if not self.overlap:
                self._finish_grads(io, returning)
        self._finish_grads(io, returning)
        self.workspace.release()
        dwk, dwv = (None if g is None else g.to(w.dtype) for g, w in ((dwk, wk), (dwv, wv)))
        return io.dx, dwq, dwk, dwv

    def _send_backward_inputs(self, io: _PassIO, weights: _Weights, stage: int) -> _BackwardExchanges:
        """Start the exchanges a backward stage needs: its q, re-projected (with its round's k and v when
        they travel with it, or in an exchange of their own just before it when the stage opens a round),
        then its output and its output gradient, each in an exchange of its own: torch's flash backward
        copies an `out` or `grad_out` whose rows are not contiguous (a column slice of a packed exchange),
        which at the backward's peak would cost two more [S, U/cp, d] tensors."""
        u = self.plan.stage_heads_per_rank * self.head_dim
        heads, kv_sent = self._stage_heads(io, weights, stage)
        q_sent = self._send(io, heads, self._role("recv_stage", stage, period=3), kv_sent=kv_sent)
        # Pieces, not projections: the _HeadExchange keeps none of them, so each is freed once packed.
        o_sent = self._send(io, [_HeadBlock(u, piece=self._stage_output(io.out, stage))],
                            self._role("recv_out", stage, self._out_period), heads=[])
        if isinstance(io.out, list):
            io.out[stage] = None  # packed and sent: the stage's output is needed no more
        do_sent = self._send(io, [_HeadBlock(u, piece=self._output_grad_piece(io.dout, stage))],
                             self._role("recv_dout", stage, self._out_period), heads=[])
        return _BackwardExchanges(q_sent, o_sent, do_sent)

    def _receive_backward_inputs(self, sent: _BackwardExchanges):
        """Wait for a backward stage's exchanges: its q, o, do and its round's k, v when they came with it
        (else None), over the full sequence."""
        k_v = [self._full_sequence(t) for t in self._receive(sent.q.kv)] if sent.q.kv is not None else [None, None]
        heads = [self._full_sequence(t) for t in self._receive(sent.q)]
        o, do = (self._full_sequence(self._receive(s)[0]) for s in (sent.o, sent.do))
        if self._kv_with_stage:
            k_v = heads[:2]
        return heads[-1], o, do, *k_v

    def _sum_kv_grads(self, sums, dk: torch.Tensor, dv: torch.Tensor):
        """Running sums of a round's dk and dv over its stages, in fp32 workspace buffers (cast once, when
        they are packed to be sent back)."""
        if sums is None:
            acc = torch.promote_types(dk.dtype, torch.float32)
            return tuple(self.workspace.get(role, g.shape, g, acc).copy_(g) for role, g in (("dk_sum", dk),
                                                                                          ("dv_sum", dv)))
        return sums[0].add_(dk), sums[1].add_(dv)

    def _send_grads(self, io: _PassIO, blocks: list[_HeadBlock], grads: list[torch.Tensor], role: str) -> _HeadExchange:
        """Start sending each projected block's gradient [B*S, heads, d] back to its tokens' ranks, in one
        all-to-all. Empties `grads`, so the gradients are freed once sent."""
        returned = [_HeadBlock(b.width, full=g) for b, g in zip(blocks, grads)]
        grads.clear()
        return self._send(io, returned, role, heads=blocks)

    def _finish_grads(self, io: _PassIO, returning: list[_HeadExchange]) -> None:
        """Wait for each returned gradient (this rank's tokens, every source rank's heads), in order, and
        accumulate dx (rounded once for all of them) and the blocks' weight-gradient rows; empties `returning`."""
        received_grads = []
        for sent in returning:
            received = sent.exchange.wait()
            for block, cols in zip(sent.heads, sent.columns):
                if block.rotary:
                    _rotate_halves_(received[..., cols].unflatten(-1, (-1, self.head_dim)), io.rotary,
                                    inverse=True)
            received_grads.append((sent.heads, received))
        if received_grads:
            self._project_back(io, received_grads)
        returning.clear()

    # --- blocks of heads ---

    def _q_heads(self, w, grad, stage: int) -> _HeadBlock:
        """Stage `stage`'s q heads: the j-th block of U/cp heads of every rank's H/cp."""
        u = self.plan.stage_heads_per_rank
        return _HeadBlock(u * self.head_dim, rows=self._q_rows(w, stage), grad_rows=self._q_rows(grad, stage),
                      rotary=True)

    def _q_rows(self, w, stage: int):
        """Rows of stage `stage`'s q heads for each rank, [cp, U/cp*d, hidden] (a view); None for None."""
        if w is None:
            return None
        u, d = self.plan.stage_heads_per_rank, self.head_dim
        per_rank = w.view(self.cp, self.plan.q_heads_per_rank, d, w.shape[-1])
        return per_rank[:, stage * u:(stage + 1) * u].flatten(1, 2)

    def _k_heads(self, w, grad, kv_round: int) -> _HeadBlock:
        return self._kv_heads(w, grad, kv_round, rotary=True)

    def _v_heads(self, w, grad, kv_round: int) -> _HeadBlock:
        return self._kv_heads(w, grad, kv_round, rotary=False)

    def _kv_heads(self, w, grad, kv_round: int, rotary: bool) -> _HeadBlock:
        """A kv round's heads of weight w: rank r takes its own block, or with replication
        (one round) kv head r // replication."""
        p, d, hidden = self.plan, self.head_dim, w.shape[-1]
        width = p.kv_heads_per_round * d
        if p.kv_replication > 1:
            rows = w.view(p.num_kv_heads, 1, d, hidden).expand(-1, p.kv_replication, -1, -1).reshape(self.cp, d, hidden)
            grad_rows = grad.view(p.num_kv_heads, d, hidden) if grad is not None else None
            return _HeadBlock(width, rows, grad_rows, replicas=p.kv_replication, rotary=rotary)
        kh = p.kv_heads_per_round

        def block(t):
            return t.view(self.cp, p.kv_heads_per_rank, d, hidden)[:, kv_round * kh:(kv_round + 1) * kh].flatten(1, 2)

        return _HeadBlock(width, block(w), block(grad) if grad is not None else None, rotary=rotary)

    def _stage_output(self, out, stage: int) -> torch.Tensor:
        """Stage `stage`'s heads of the output, [B, S/cp, cp, U/cp, d]: its own tensor when kept by stage, else a
        view of the whole."""
        if isinstance(out, list):
            if out[stage] is None:
                raise RuntimeError(f"Untied Ulysses: stage {stage}'s output was already sent and freed")
            return out[stage]
        return self._output_piece(out, stage)

    def _stage_columns(self, wo: torch.Tensor, stage: int) -> torch.Tensor:
        """The columns of `wo` [hidden, H*d] that multiply stage `stage`'s heads, [hidden, cp * U/cp * d] (a copy)."""
        return self._output_piece(wo.unsqueeze(0), stage)[0].reshape(wo.shape[0], -1)

    def project_output(self, outs: list[torch.Tensor], wo: torch.Tensor) -> torch.Tensor:
        """o_proj of an output kept by stage: y = sum over stages of out_j @ wo_j^T, summed in fp32 a row chunk at
        a time and rounded once (as one GEMM over all heads rounds once)."""
        B, s = outs[0].shape[:2]
        columns = [self._stage_columns(wo, stage).t() for stage in range(len(outs))]
        y = outs[0].new_empty(B, s, wo.shape[0])
        acc_dtype = torch.promote_types(y.dtype, torch.float32)
        for b in range(B):
            for start, end in self.tile_bounds(s, -(-s // DX_CHUNK_ROWS)):
                acc = torch.zeros(end - start, wo.shape[0], dtype=acc_dtype, device=y.device)
                for out, cols in zip(outs, columns):
                    addmm_fp32_(acc, out[b, start:end].reshape(end - start, -1), cols, self.fp32_out_gemm)
                y[b, start:end].copy_(acc)
                del acc
        return y

    def output_weight_grad(self, grad: torch.Tensor, out, wo: torch.Tensor) -> torch.Tensor:
        """o_proj's weight gradient grad^T @ out [hidden, H*d], for an output whole or kept by stage (a GEMM per
        stage, each writing its heads' columns)."""
        grad2d = grad.reshape(-1, grad.shape[-1])
        if not isinstance(out, list):
            return torch.mm(grad2d.t(), out.reshape(-1, out.shape[-1]))
        dwo = torch.empty_like(wo)
        for stage, o in enumerate(out):
            self._output_piece(dwo.unsqueeze(0), stage)[0].copy_(
                torch.mm(grad2d.t(), o.reshape(grad2d.shape[0], -1)).view(wo.shape[0], self.cp, -1, self.head_dim))
        return dwo

    def _output_piece(self, t: torch.Tensor, stage: int) -> torch.Tensor:
        """Stage `stage`'s heads of t [B, S/cp, H*d] as a view [B, S/cp, cp, U/cp, d]."""
        u, d = self.plan.stage_heads_per_rank, self.head_dim
        per_rank = t.view(t.shape[0], t.shape[1], self.cp, self.plan.q_heads_per_rank, d)
        return per_rank[:, :, :, stage * u:(stage + 1) * u]

    def _output_grad_piece(self, dout: OutputGradient, stage: int) -> torch.Tensor:
        """Stage `stage`'s heads of the attention-output gradient, [B, S/cp, cp, U/cp, d]: a view of it, or
        with `wo` the product of the projection's gradient with the stage's columns of `wo` (a stage's
        share: the whole [B, S/cp, H*d] gradient never exists)."""
        if dout.wo is None:
            return self._output_piece(dout.grad, stage)
        u, d = self.plan.stage_heads_per_rank, self.head_dim
        columns = self._output_piece(dout.wo.unsqueeze(0), stage)  # [1, hidden, cp, U/cp, d]
        grad = dout.grad
        piece = torch.matmul(grad.reshape(-1, grad.shape[-1]), columns.reshape(grad.shape[-1], -1))
        return piece.view(grad.shape[0], grad.shape[1], self.cp, u, d)

    # --- exchanges ---

    def _begin(self, x, cos, sin, cu_seqlens, out, lses, norm=None) -> _PassIO:
        self.workspace.begin(x)
        shape = (x.shape[0], 1, x.shape[1], 1, self.head_dim)
        return _PassIO(x, cos.reshape(shape), sin.reshape(shape), cu_seqlens, out, lses, norm=norm)

    def _full_sequence(self, received: torch.Tensor) -> torch.Tensor:
        """A received block [B, cp, s, width] (index 1: the source rank's tokens) as [B*S, heads, d]; a view."""
        return received.view(-1, received.shape[-1] // self.head_dim, self.head_dim)  # never a copy

    def _start_all_to_all(self, io: _PassIO, blocks: list[_HeadBlock], role: str) -> _InFlight:
        """Build every block for every rank and start exchanging them in one all-to-all into role's buffer
        [B, cp, s, columns] (index 1: the source rank); asynchronous with overlap, else done on return."""
        B, s = io.batch, io.local_len
        if len(blocks) == 1 and blocks[0].full is not None and blocks[0].full.dtype == io.x.dtype:
            # already in exchange layout
            send = blocks[0].full.contiguous().view(B, self.cp, s, -1)
        else:
            send = self._pack(io, blocks)
        recv = self.workspace.get(role, send.shape, send)
        works = [dist.all_to_all_single(recv[b], send[b], group=self.group, async_op=self.overlap)
                 for b in range(B)]
        return _InFlight(recv, works, send) if self.overlap else _InFlight(recv, [], None)

    def _pack(self, io: _PassIO, blocks: list[_HeadBlock]) -> torch.Tensor:
        """A send buffer [B, cp, s, columns] holding the blocks side by side (projected ones first)."""
        B, s, d = io.batch, io.local_len, self.head_dim
        send = io.x.new_empty(B, self.cp, s, sum(b.width for b in blocks))
        projected = [b for b in blocks if b.rows is not None]
        if projected:
            self._project_into(io, projected, send[..., :sum(b.width for b in projected)])
        for block, cols in zip(blocks, self._columns(blocks)):
            part = send[..., cols]
            if block.rotary:
                _rotate_halves_(part.unflatten(-1, (-1, d)), io.rotary)
            elif block.piece is not None:
                part.unflatten(-1, (-1, d)).copy_(block.piece.transpose(1, 2))
            elif block.full is not None:
                part.copy_(block.full.view(B, self.cp, s, -1))
        return send

    @staticmethod
    def _columns(blocks: list[_HeadBlock]) -> list[slice]:
        """Column range of each block in a packed exchange."""
        starts = [0]
        for block in blocks:
            starts.append(starts[-1] + block.width)
        return [slice(a, b) for a, b in itertools.pairwise(starts)]

    # --- projections ---

    def _add_to_dx(self, io: _PassIO, terms: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """dx[b] += sum over (rows, grad) in `terms` and ranks r of grad[b, r] @ rows[r], summed in fp32 and
        rounded once per call.

        Row chunk by row chunk, in an fp32 buffer of DX_CHUNK_ROWS rows: a full fp32 dx would hold
        S/cp x hidden x 4 bytes (10 GiB for Llama3-8B at 5M tokens on 8 GPUs) through the
        backward's peak. dx is rounded once per backward stage (4 for that recipe), where summing in
        place would round once per rank and exchange (40 or more).
        """
        acc_dtype = torch.promote_types(io.dx.dtype, torch.float32)
        chunks = -(-io.local_len // DX_CHUNK_ROWS)
        ranks = list(self.rank_loop(self.cp))
        by_rank = [rows.unbind(0) for rows, _ in terms]  # views taken once (the planner traces each view)
        for b in range(io.batch):
            grads = [grad[b].unbind(0) for _, grad in terms]  # [s, columns] per rank
            dx = io.dx[b]
            for start, end in self.tile_bounds(io.local_len, chunks):
                acc = dx[start:end].to(acc_dtype)
                for rows, grad in zip(by_rank, grads):
                    for r in ranks:
                        addmm_fp32_(acc, grad[r][start:end], rows[r], self.fp32_out_gemm)
                dx[start:end].copy_(acc)
                del acc

    @staticmethod
    def _stacked_rows(blocks: list[_HeadBlock]) -> torch.Tensor:
        """The blocks' weight rows side by side: [cp, sum of widths, hidden]."""
        return blocks[0].rows if len(blocks) == 1 else torch.cat([block.rows for block in blocks], dim=1)

    def _project_into(self, io: _PassIO, blocks: list[_HeadBlock], send: torch.Tensor) -> None:
        """send[b, r] = x[b] @ (blocks' rows for rank r)^T: one GEMM per sample and rank."""
        # Each sample's views taken once, not once per rank (the planner traces every view it takes).
        xs, sends = io.x.unbind(0), send.unbind(0)
        rstds = io.norm.rstd.unsqueeze(-1).unbind(0) if io.norm is not None else None
        for r in self.rank_loop(self.cp):
            # One rank's rows at a time: stacking every rank's would add a weight-slice copy
            # to the moment both exchange buffers are full.
            rows = torch.cat([block.rows[r] for block in blocks]) if len(blocks) > 1 else blocks[0].rows[r]
            if io.norm is not None:
                rows = rows * io.norm.weight  # xn @ rows^T = rstd * (x @ (rows * weight)^T)
            rows_t = rows.t()
            for b in range(io.batch):
                out = sends[b][r]
                torch.mm(xs[b], rows_t, out=out)
                if rstds is not None:
                    out.mul_(rstds[b])

    def _project_back(self, io: _PassIO, received: list[tuple[list[_HeadBlock], torch.Tensor]]) -> None:
        """The transpose of `_project_into` for each (blocks, grad [B, cp, s, columns]) received (the blocks
        side by side): dx += grad @ rows, and the blocks' weight-gradient rows += grad^T x, both summed over
        ranks and samples in fp32 (see `_add_to_dx`)."""
        if io.dx is not None:
            self._add_to_dx(io, [(self._stacked_rows(blocks), grad) for blocks, grad in received])
        for blocks, grad in received:
            self._project_weight_grads(io, blocks, grad)

    def _project_weight_grads(self, io: _PassIO, blocks: list[_HeadBlock], grad: torch.Tensor) -> None:
        """The blocks' weight-gradient rows += grad^T x (x normed), in fp32; consumes `grad`."""
        stacked = None  # the weight gradient of every rank's rows, [cp, columns, hidden], fp32
        if any(block.grad_rows is not None for block in blocks):
            if io.norm is not None:  # grad^T @ xn = ((rstd * grad)^T @ x) * weight; grad is consumed here
                grad.mul_(io.norm.rstd.view(io.batch, 1, -1, 1))
            stacked = torch.zeros(self.cp, grad.shape[-1], io.x.shape[-1], device=grad.device,
                                  dtype=torch.promote_types(grad.dtype, torch.float32))
            for r in self.rank_loop(self.cp):
                for b in range(io.batch):
                    addmm_fp32_(stacked[r], grad[b, r].t(), io.x[b], self.fp32_out_gemm)
            if io.norm is not None:
                stacked.mul_(io.norm.weight.to(stacked.dtype))
        for block, cols in zip(blocks, self._columns(blocks)):
            if stacked is not None and block.grad_rows is not None:
                per_rank = stacked[:, cols]
                if block.replicas > 1:  # ranks sharing a replicated kv head: their gradients add up
                    per_rank = per_rank.unflatten(0, (-1, block.replicas)).sum(dim=1)
                block.grad_rows.add_(per_rank)
