"""One rank of a plan: ``StageWorker`` runs its stages through the schedule,
one training step at a time.

The runtime's parts, one module each (as torch.distributed.pipelining keeps
stage, schedule and P2P apart); the schedule (``ir/schedule.py``: 1F1B, GPipe,
interleaved as data) and the point-to-point program (``ir/p2p.py``) they
execute are records in ``zorse_fx.ir``:

==================  ===========================================================
``comm.py``         packed messages of the stages' boundary tensors
``p2p.py``          the plan's point-to-point program NCCL accepts, executed
``stage.py``        one stage: module, rows, forward / backward of a micro-batch
``grad_sync.py``    bucketed gradient all-reduce overlapped with the backward
``optimizer.py``    AdamW (ZeRO-1 shards, all-gather), the fp16 loss scaler
``worker.py``       this file: the rank, its process groups, one step
``launch.py``       torchrun on one machine (``zorse train``)
==================  ===========================================================

A step (``StageWorker.train_step``):

0. a token-mean plan's last-stage ranks count the tokens of their rows of
   every micro-batch and all-reduce the sum over the last stage's GPUs: the
   weights of their losses ([Note: share-weighted gradients] in
   ``stage.py``);
1. inside the precision policy's autocast region (see [Note: mixed
   precision] in ``zorse_fx/precision.py``), run the rank's GPU group's
   schedule over the micro-batches, each action on the stage it names:
   before action k post its point-to-point group and wait for the receives
   it needs ([Note: point-to-point program] in ``ir/p2p.py``), then compute
   (``StageRuntime.forward`` / ``backward``); during the backward of each
   stage's last micro-batch, gradient buckets are all-reduced as they become
   final ([Note: overlapped gradient reduction] in ``grad_sync.py``);
2. wait for the sends and the reductions;
3. fp16-mixed: unscale, agree on inf/NaN over the world, skip the step on
   every rank or none (``LossScaler``);
4. the global gradient norm (``grad_norm``: every canonical parameter counted
   once, over all stages and data-parallel groups, one all-reduce) and, with
   ``max_grad_norm``, clipping by it exactly as
   ``torch.nn.utils.clip_grad_norm_`` clips a single-process model; a norm
   that is not finite takes no optimizer step ([Note: non-finite steps]);
5. AdamW per hosted stage (on a ZeRO-1 stage only this rank's ranges) at the
   step's learning rate, then the ZeRO-1 all-gathers ([Note: ZeRO-1 with
   unequal shards] in ``optimizer.py``).

[Note: non-finite steps]
A gradient that is inf or NaN after the fp16 loss scaler (which skips a step
whose scaled gradients overflowed, on every rank alike: normal) or without
one makes the global gradient norm inf or NaN, and the norm is all-reduced,
so every rank sees it and none takes the optimizer step; each rank notes
which of its stages hold the non-finite gradients and weights
(``last_nonfinite``). The loop (``zorse_fx/train.py``) gathers that and each
rank's loss in the step's all-gather, so all ranks agree to stop, names the
step, ranks and stages, writes no checkpoint of the step and exits non-zero.

[Note: a slowed rank]
``--slow-gpu GPU:FACTOR`` (testing) makes the rank the plan puts on cluster GPU
GPU a straggler (none where the plan leaves that GPU idle; after a re-plan,
whichever rank is then on it): after each forward and backward it sleeps
``FACTOR - 1`` times that compute's own wall time (on a GPU after
synchronising the device), so its compute as the
timings measure it ([Note: step timings] in ``timings.py``) is ``FACTOR``
times its own, while the gradient reductions it launched during a backward
go on beside the sleep, as beside a slower compute. What a throttled card
or a noisy neighbour does to one GPU, without a second machine. The box
paces every rank to its GPU type's speed with a factor on the compute's CPU
time instead ([Note: paced compute] in ``zorse_fx/pacing.py``: ``self.pacer``),
which the loaded machine around it does not change.

An evaluation step (``eval_step``) runs the schedule's forwards alone
(``build_program(..., forward_only=True)``) under ``torch.no_grad``.

Every tensor a collective or a point-to-point operation touches lives on the
rank's device (the loss, the inf flag, the buckets, the messages); only the
caller's logging copies the loss to the host.

[Note: a rank with several stages]
With ``Plan.interleave = v > 1`` a rank of GPU group ``p`` (of ``P``) hosts
the stages ``p, p + P, ..., p + (v - 1) P`` (``Plan.stages_of``), each a
``StageRuntime`` with its own module, routes, optimizer and stash; they share
the rank's rows (stage ``s >= P`` lists the GPUs and shares of stage
``s % P``), its process groups and its point-to-point program. What that takes:

- process groups are created once per rank, for the keys of every stage of
  the plan, in one sorted order on every rank (``dist.new_group`` is
  collective over the world), and shared by the rank's stages: a key is the
  same communicator on every rank, whichever stage uses it;
- the rank runs its group's list (``make_schedule(...)[p]``); action
  ``(kind, m, c)`` runs stage ``p + c P``;
- two ranks now exchange messages for several stage pairs (with ``P = 2``,
  group 0 sends stages 0 -> 1 and 2 -> 3 to group 1, group 1 sends stage
  1 -> 2 back to group 0) over one channel per direction; the program gives
  both ends the same order of those messages, and no tag is needed. A
  message to the rank itself (stages ``b`` and ``b + 1`` on one group:
  ``P = 1``) is handed over in memory;
- gradients are reduced per canonical parameter: the copies one rank holds
  (a parameter tied between two of its stages) are summed locally, in stage
  order, then all-reduced over the union of the holders' ranks, then written
  back into every copy, which therefore stay equal. Buckets follow one global
  parameter order (first appearance in the plan's stages, reversed), so every
  member issues the same collectives with the same buckets in the same order;
- optimizer steps and ZeRO-1 all-gathers run per stage, in stage order; a
  group's stages all have the group's ranks, so every member of a shard
  group issues the same broadcasts in the same order.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..errors import RuntimeExecutionError
from ..pacing import Pacer
from ..plan import Plan, StagePlan
from ..precision import PrecisionPolicy, precision_policy
from .grad_sync import GradientReducer, holders_of
from .optimizer import LossScaler, OptimizerConfig, StageOptimizer
from .p2p import P2PExecutor, build_program
from .stage import StageRuntime
from .timings import StepTimer, num_marks

__all__ = ["StageWorker", "OptimizerConfig"]


class StageWorker:
    """Executes one rank's part of ``plan``: every stage the rank hosts
    (``plan.stages_of(rank)``, see [Note: a rank with several stages]).
    Call on every rank of the world (process groups are created collectively).

    Args:
        plan, plan_dir: the plan and the directory of its stage sources.
        weights: every tensor of the model by canonical name.
        rank, device: this rank and its device.
        optimizer: AdamW hyper-parameters.
        precision: the policy to train with (default fp32).
        weights_source: the file ``weights`` was read from, named by a
            ``WeightsFileError`` (a tensor missing or of the wrong shape or dtype).
        timings: time every step's phases ([Note: step timings] in
            ``timings.py``; ``last_timings``); False: ``last_timings`` is empty.
    """

    def __init__(
        self,
        plan: Plan,
        plan_dir: str | Path,
        weights: dict[str, torch.Tensor],
        *,
        rank: int,
        device: torch.device,
        optimizer: OptimizerConfig = OptimizerConfig(),
        precision: PrecisionPolicy | None = None,
        weights_source: str | None = None,
        timings: bool = True,
    ):
        self.plan = plan
        self.rank = rank
        self.device = device
        self.precision = precision or precision_policy("fp32")
        self.precision.apply_matmul_precision(device.type)  # TF32 as planned (zorse_fx/precision.py)
        self.role = plan.role(rank)
        #: The rank's GPU group (= its first stage).
        self.group = self.role.stage
        self.program = build_program(plan, rank, precision=self.precision)
        #: The rank's actions (its GPU group's schedule).
        self.schedule = self.program.actions
        self._build_groups()
        #: The stages this rank hosts, in stage order.
        self.stages: list[StageRuntime] = [
            StageRuntime(plan, index, Path(plan_dir), weights, rank=rank, device=device, precision=self.precision,
                         weights_source=weights_source)
            for index in plan.stages_of(rank)]
        self._by_index = {st.index: st for st in self.stages}
        self.optimizers = [StageOptimizer(st, optimizer, shard_group=self._groups.get(tuple(sorted(st.stage.ranks))),
                                          precision=self.precision)
                           for st in self.stages]
        self.reducer = GradientReducer(plan, self.stages, self._groups, precision=self.precision,
                                       bucket_bytes=plan.grad_bucket_bytes,  # what the planner priced
                                       main_grad=[p for opt in self.optimizers for p in opt.low_params],
                                       shard_buffers=[(st, opt.buffers) for st, opt in zip(self.stages, self.optimizers)
                                                      if opt.zero1 and st.stage.memory.zero >= 2])
        for opt in self.optimizers:
            opt.grad_of = self.reducer.grad_of
            opt.piece_grad = self.reducer.piece_grad
        self.scaler = LossScaler(self.precision, device) if self.precision.loss_scaling else None
        P = plan.num_groups
        #: Per hosted stage: the index of its last backward in the schedule.
        self._last_backward = {self.group + a.chunk * P: k for k, a in enumerate(self.schedule) if a.kind == "B"}
        self._p2p = P2PExecutor(self.program, device)
        #: The boundaries of every step's phases; ``last_timings`` their durations.
        self.timer = StepTimer(device, num_marks(plan), enabled=timings)
        self.last_timings: list[float] = []
        self._bucketed = {id(p) for e in self.reducer.entries for _, p in e.copies}
        holders = holders_of(plan)
        #: Parameters whose squared gradient norm this rank adds to the global
        #: norm: each canonical name once, on the lowest rank holding it.
        self._norm_params = list({canon: p for st in self.stages for canon, p in st.params().items()
                                  if holders[canon][0] == rank and not self.reducer.is_sharded(p)}.values())
        self._eval = None  # (program, executor) of the forward-only step, built on first use
        #: Steps run so far, and optimizer steps taken (steps not skipped by the loss scaler).
        self.steps = 0
        self.optimizer_steps = 0
        #: The global gradient norm of the last step (0-dim float32 on the device), before clipping.
        self.last_grad_norm = None
        #: Testing: steps (1-based) after whose reduction this rank writes an inf into a gradient.
        self.inject_inf_steps: set[int] = set()
        #: Testing (``--slow-gpu``): every forward and backward takes this many times its own time.
        self.slow_factor = 1.0
        #: On the box: every forward, backward and optimizer step takes the pacer's factor x its CPU time
        #: (``ZORSE_PACE``, [Note: paced compute] in zorse_fx/pacing.py); factor 1 elsewhere.
        self.pacer = Pacer(1.0)
        #: fp16-mixed: whether the last step was skipped, and the scale it used.
        self.last_skipped = False
        self.last_loss_scale = 1.0
        #: Whether the last step's global gradient norm was not finite (no optimizer step taken):
        #: ``nonfinite_stages()`` then, else None. See [Note: non-finite steps].
        self.last_nonfinite: tuple[int | None, int | None] | None = None

    def add_inject_inf(self, step: int) -> None:
        """Testing (``--inject-inf RANK:STEP``): after step ``step``'s reduction, write an inf
        into a gradient this rank adds to the global norm (``_norm_params``, or its ZeRO-2
        shard), else, under fp16's loss scaler (which checks every gradient of every rank),
        into any of its gradients. Without a scaler a gradient the norm does not count would
        reach only this replica's optimizer, unseen by the non-finite check ([Note: non-finite
        steps]), which is no test of it.

        Raises:
            RuntimeExecutionError: no loss scaler, and this rank counts no gradient in the norm
                (its parameters are counted on the lowest rank holding them), naming the ranks
                that do.
        """
        if self.scaler is None and not self._norm_params and not any(
                self.reducer.is_sharded(p) for st in self.stages for p in st.params().values()):
            owners = sorted({ranks[0] for ranks in holders_of(self.plan).values()})
            raise RuntimeExecutionError(
                f"--inject-inf {self.rank}:{step}: rank {self.rank} adds no gradient to the global norm (each "
                f"parameter's gradient is counted once, on the lowest rank holding it), so an inf written there "
                f"would reach its own optimizer only; use one of ranks {', '.join(map(str, owners))}")
        self.inject_inf_steps.add(step)

    @property
    def stage(self) -> StagePlan:
        """The rank's first stage (its only one without interleaving)."""
        return self.stages[0].stage

    @property
    def module(self) -> torch.nn.Module:
        """The first stage's module (its only one without interleaving)."""
        return self.stages[0].module

    # -- process groups -----------------------------------------------------
    def _build_groups(self) -> None:
        """Create every reduction / all-gather group of the plan on every rank,
        once, in one global order (shared by the rank's stages)."""
        holders = holders_of(self.plan)
        keys = {k for k in holders.values() if len(k) > 1}
        # All-gather groups of the sharded stages (often equal to a reduction group: shared).
        keys |= {tuple(sorted(s.ranks)) for s in self.plan.stages if s.memory.zero and len(s.gpus) > 1}
        # The last stage's GPUs sum a token-mean loss's counts ([Note: share-weighted gradients] in stage.py).
        last = tuple(sorted(self.plan.stages[-1].ranks))
        counted = self.plan.loss_reduction == "token_mean" and len(last) > 1
        if counted:
            keys.add(last)
        self._groups = {k: dist.new_group(list(k)) for k in sorted(keys)}
        #: The group the rank sums the token counts over (a token-mean plan's last stage of >1 GPU), else None.
        self._count_group = self._groups[last] if counted and self.rank in last else None

    # -- one step -----------------------------------------------------------
    def _count_loss_tokens(self, batch: dict[str, torch.Tensor]) -> None:
        """A token-mean plan's last stage, if the rank hosts it: count the tokens of its rows of every
        micro-batch, all-reduce their sum over the stage's GPUs (one float64 scalar on the device) and
        set the stage's loss weights ([Note: share-weighted gradients] in ``stage.py``). One copy of
        the counts to the host per step, before the schedule."""
        st = self._by_index.get(self.plan.num_stages - 1)
        if st is None or not st.token_mean:
            return
        counts = st.count_tokens(batch)
        total = counts.sum().reshape(1)
        if self._count_group is not None:
            dist.all_reduce(total, group=self._count_group)
        *mine, whole = torch.cat([counts, total]).tolist()
        st.set_loss_weights(mine, whole)

    def _sync(self) -> None:
        if self.device.type == "cuda":  # phase times below are wall times of the device's work
            torch.cuda.synchronize(self.device)

    def train_step(self, batch: dict[str, torch.Tensor], *, lr: float | None = None,
                   max_grad_norm: float | None = None) -> torch.Tensor:
        """Run one training step on the global ``batch`` (``{input: (N, T)}``)
        at learning rate ``lr`` (default: the optimizer's), clipping the global
        gradient norm to ``max_grad_norm`` (None: no clipping).

        Returns this rank's weighted loss contribution, a 0-dim float32
        tensor on the device (the sum over ranks is the global batch's loss,
        its mean over the samples or over the counted tokens; 0 on ranks
        without a last stage). Sets ``last_breakdown`` (seconds:
        ``start_unix_s`` = the step's start on the wall clock (``time.time()``: the
        phases of different ranks line up; across hosts to their clocks' offset),
        ``pipeline_s`` = schedule incl. waits for messages, ``allreduce_s`` =
        waiting for the gradient reductions still in flight after it,
        ``optimizer_s`` = loss-scale check + AdamW, ``allgather_s`` = ZeRO-1
        all-gathers; and ``buckets`` / ``buckets_during_backward``: gradient
        buckets of the rank, and how many were launched while a backward was
        still running). Sets ``last_timings``: the seconds of every phase
        ([Note: step timings] in ``timings.py``)."""
        self.steps += 1
        scale = self.scaler.scale if self.scaler else 1.0
        self.last_loss_scale = scale
        t_start, wall_start = time.perf_counter(), time.time()
        for st in self.stages:
            st.start_step()
            st.loss_scale = scale
            for p in st.module.parameters():
                if id(p) not in self._bucketed:
                    p.grad = None
        self.reducer.start_step()
        timer = self.timer
        timer.start()
        self._count_loss_tokens(batch)
        timer.mark()
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        P, sent, p2p = self.plan.num_groups, [], self._p2p
        with self.precision.autocast(self.device.type):
            for k, action in enumerate(self.schedule):
                p2p.post(k, sent)
                timer.mark()
                received = p2p.received(k)
                timer.mark()
                st = self._by_index[self.group + action.chunk * P]
                t_compute = time.perf_counter()
                paced = self.pacer.start() if self.pacer.active else None
                if action.kind == "F":
                    contribution, sent = st.forward(action.microbatch, batch, received)
                    if contribution is not None:
                        loss += contribution
                else:
                    final = k == self._last_backward[st.index]
                    if final:
                        self.reducer.begin_final(st.index)
                    sent = st.backward(action.microbatch, received)
                    self.reducer.end_backward(st.index)
                    if final:
                        self.reducer.end_final(st.index)
                if paced is not None:  # the box: this CPU thread as a slower GPU ([Note: paced compute])
                    self.pacer.finish(paced)
                if self.slow_factor > 1.0:  # testing: a straggler ([Note: a slowed rank])
                    self._sync()
                    time.sleep((self.slow_factor - 1.0) * (time.perf_counter() - t_compute))
                timer.mark()
            p2p.post(len(self.schedule), sent)
            p2p.finish()
        timer.mark()
        self._sync()
        t_pipeline = time.perf_counter()
        self.reducer.wait()
        timer.mark()
        self._sync()
        t_reduce = time.perf_counter()
        skip = False
        if self.steps in self.inject_inf_steps:  # testing: into a gradient this rank adds to the global norm
            grads = [g for g in map(self.reducer.grad_of, self._norm_params) if g is not None]
            grads += self.reducer.shard_grads()
            grads = grads or self._grads()  # (add_inject_inf: only where the loss scaler checks every gradient)
            grads[0].view(-1)[0] = float("inf")
        if self.scaler is not None:
            self.scaler.unscale_and_check(self._grads())
            skip = self.scaler.agree()
            self.scaler.update(skip)
        timer.mark()
        self.last_skipped = skip
        self.last_grad_norm = None  # (not computed on a skipped step: the gradients hold inf/NaN)
        self.last_nonfinite = None
        if not skip:
            norm = self.last_grad_norm = self._global_grad_norm()
            if not bool(torch.isfinite(norm)):  # [Note: non-finite steps]; the same on every rank (all-reduced)
                self.last_nonfinite = self.nonfinite_stages()
                skip = True
        timer.mark()
        if not skip:
            if max_grad_norm is not None:
                grads = self._grads()
                coef = torch.clamp(max_grad_norm / (norm + 1e-6), max=1.0)  # clip_grad_norm_'s rule
                torch._foreach_mul_(grads, coef)
            with self.pacer.paced():
                for opt in self.optimizers:
                    if lr is not None:
                        opt.set_lr(lr)
                    opt.step()
            self.optimizer_steps += 1
        timer.mark()
        self._sync()
        t_step = time.perf_counter()
        if not skip:
            for w in [w for opt in self.optimizers for w in opt.allgather()]:
                w.wait()
        timer.mark()
        self._sync()
        t_end = time.perf_counter()
        self.last_timings = timer.durations() if timer.enabled else []
        self.last_breakdown = {"start_unix_s": wall_start,
                               "pipeline_s": t_pipeline - t_start, "allreduce_s": t_reduce - t_pipeline,
                               "optimizer_s": t_step - t_reduce, "allgather_s": t_end - t_step,
                               "buckets": self.reducer.num_buckets,
                               "buckets_during_backward": self.reducer.launched_during_backward}
        return loss

    def nonfinite_stages(self) -> tuple[int | None, int | None]:
        """(the first of the rank's stages holding a non-finite gradient, the
        first holding a non-finite weight; None where there is none): the
        gradients this rank holds (ZeRO-2: its shards) and the weights (ZeRO-3:
        its owned ranges; 16-bit working weights: their float32 masters too).
        Run only when a step is not finite: it reads every tensor once."""

        def bad(tensors) -> bool:
            return any(not bool(torch.isfinite(t).all()) for t in tensors if t is not None and t.numel())

        grad_stage = weight_stage = None
        for st, opt in zip(self.stages, self.optimizers):
            grads = [self.reducer.grad_of(p) for p in st.params().values() if not self.reducer.is_sharded(p)]
            grads += [self.reducer.piece_grad(p, a, b) for p, a, b in opt.owned_pieces() if self.reducer.is_sharded(p)]
            weights = ([t for *_, t in st.param_shards.owned_values()] if st.param_shards is not None
                       else list(st.params().values()))
            weights += [t for *_, t in opt.master_pieces()]
            if grad_stage is None and bad(grads):
                grad_stage = st.index
            if weight_stage is None and bad(weights):
                weight_stage = st.index
        return grad_stage, weight_stage

    def _grads(self) -> list[torch.Tensor]:
        """Every gradient of the rank's stages (a 16-bit working weight's: its float32 main gradient)."""
        grads = [self.reducer.grad_of(p) for st in self.stages for p in st.params().values()]
        grads += self.reducer.shard_grads()  # ZeRO-2: this rank's float32 gradient shards
        return list({id(g): g for g in grads if g is not None}.values())

    def _global_grad_norm(self) -> torch.Tensor:
        """The L2 norm of every reduced gradient of the model (one all-reduce
        over the world): each rank adds the squares of the parameters it owns
        (``_norm_params``), so a parameter replicated over a data-parallel
        group or tied between stages counts once, as in a single process."""
        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        grads = [g for g in map(self.reducer.grad_of, self._norm_params) if g is not None]
        grads += self.reducer.shard_grads()  # ZeRO-2: each element once, on its owner
        if grads:
            with self.pacer.paced():  # (compute on a GPU: the box paces it, as the profile measured it)
                norms = torch._foreach_norm(grads, 2.0)
                sq = torch.stack([n.float() for n in norms]).pow(2).sum()
        if dist.is_initialized():  # (a one-rank plan may run without a process group, in-process)
            dist.all_reduce(sq)
        return sq.sqrt()

    @torch.no_grad()
    def eval_step(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """The loss on ``batch`` without training: the schedule's forwards only,
        no gradients. Returns this rank's weighted contribution (0-dim float32
        on the device; the sum over ranks is the batch's loss: its mean over
        the samples or over the counted tokens, as training's)."""
        if self._eval is None:
            program = build_program(self.plan, self.rank, forward_only=True, precision=self.precision)
            self._eval = (program, P2PExecutor(program, self.device))
        program, p2p = self._eval
        P, sent = self.plan.num_groups, []
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        for st in self.stages:
            st.start_step()
        self._count_loss_tokens(batch)
        with self.precision.autocast(self.device.type):
            for k, action in enumerate(program.actions):
                p2p.post(k, sent)
                received = p2p.received(k)
                st = self._by_index[self.group + action.chunk * P]
                with self.pacer.paced():
                    contribution, sent = st.forward(action.microbatch, batch, received)
                if contribution is not None:
                    loss += contribution
            p2p.post(len(program.actions), sent)
            p2p.finish()
        for st in self.stages:
            st.start_step()  # drop the stashed activations
        return loss

    # -- inspection -----------------------------------------------------------
    def _merged(self, per_stage, what: str, same) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for st, tensors in zip(self.stages, per_stage):
            for canon, t in tensors.items():
                if canon in out:
                    if not same(out[canon], t):
                        raise AssertionError(f"rank {self.rank}: the copies of {canon!r} held by its stages "
                                             f"{[s.index for s in self.stages]} have different {what}")
                else:
                    out[canon] = t
        return out

    def gradients(self) -> dict[str, torch.Tensor]:
        """Current gradients by canonical parameter name (after reduction),
        over the rank's stages (a parameter two of them hold appears once)."""
        grad_of = self.reducer.grad_of
        per_stage = [{canon: grad_of(p).detach().clone() for canon, p in st.params().items() if grad_of(p) is not None}
                     for st in self.stages]
        return self._merged(per_stage, "gradients", torch.equal)

    def gradient_pieces(self) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
        """The reduced gradients this rank holds of ZeRO-2 parameters
        (``StagePlan.grad_sharded``), by canonical name: ``(start, end,
        values)`` of elements ``[start, end)`` of the flattened parameter, its
        owned range ([Note: sharded gradients] in ``grad_sync.py``).
        ``gradients`` gives every other parameter's whole gradient."""
        out: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        for opt in self.optimizers:
            for p, a, b in opt.owned_pieces():
                if self.reducer.is_sharded(p):
                    out.setdefault(opt.canonical[id(p)], []).append(
                        (a, b, self.reducer.piece_grad(p, a, b).detach().clone()))
        return out

    def parameters_by_name(self) -> dict[str, torch.Tensor]:
        """Parameters by canonical name over the rank's stages (one per name).
        Collective where a stage is ZeRO-3 (its units are gathered for the
        copy): every rank calls it at the same point."""
        per_stage = []
        for st in self.stages:
            with self.gathered(st):
                per_stage.append({canon: p.detach().clone() for canon, p in st.params().items()})
        return self._merged(per_stage, "values", lambda a, b: torch.allclose(a, b, rtol=1e-6, atol=0))

    @staticmethod
    def gathered(st: StageRuntime):
        """Stage ``st``'s whole parameters for the block: ZeRO-3 gathers them
        (collective over the stage's GPUs, [Note: sharded parameters]); a
        no-op elsewhere."""
        return st.param_shards.gathered() if st.param_shards is not None else contextlib.nullcontext()

    def master_weights(self) -> dict[str, list[tuple[int, int, torch.Tensor]]]:
        """The float32 masters this rank holds of 16-bit working weights
        (``StagePlan.low_precision_params``), by canonical name: ``(start,
        end, values)`` of elements ``[start, end)`` of the flattened parameter
        (the rank's ZeRO-1 range). ``parameters_by_name`` gives those
        parameters' 16-bit working values."""
        out: dict[str, list[tuple[int, int, torch.Tensor]]] = {}
        for opt in self.optimizers:
            for canon, a, b, t in opt.master_pieces():
                out.setdefault(canon, []).append((a, b, t.detach().clone()))
        return out

    def optimizer_state_summary(self) -> dict:
        """Elements owned and bytes of AdamW state held (moments; the scalar
        ``step`` counters are not counted), after at least one step.

        The top-level keys describe the rank's first stage (its only one
        without interleaving); ``stages`` lists the same record for every
        stage the rank hosts, in stage order. Per stage:

        ``owned_elements`` / ``optimizer_state_bytes``: totals over dtypes.
        ``owned_range``: this rank's range of the stage's elements when the
        stage has one buffer (one dtype, or not sharded: all of them); None
        for a sharded stage with several dtypes, whose ranges are per dtype.
        ``buffers``: per dtype (buffer order), ``elements`` (n_d), this rank's
        ``owned_range`` = ``StagePlan.shard_ranges(n_d)[position]`` (all
        ``[0, n_d]`` when not sharded), ``owned_elements`` and the
        ``optimizer_state_bytes`` of that dtype's parameters (``2 x owned x
        itemsize`` for AdamW)."""
        summaries = [opt.state_summary() for opt in self.optimizers]
        return {**summaries[0], "stages": summaries}
