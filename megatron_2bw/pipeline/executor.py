"""Runs one stage's schedule actions with real tensors: one loop, one branch per action kind.

The same action lists drive the validator, the planner's simulator and the schedule picture. A rank
holding several model chunks (interleaved) runs each action on its chunk and keys its tensors by
(chunk, microbatch); a split backward runs B (input gradient, sent on at once) and W (weight
gradients) as two actions (split_backward.py).
"""
from __future__ import annotations

import collections
from contextlib import nullcontext
from typing import Callable, Iterable

import torch

from megatron_2bw.distributed.p2p import PipelineP2P
from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.split_backward import backward_input, backward_weight
from megatron_2bw.pipeline.update import GradientUpdater, StepResult
from megatron_2bw.pipeline.weights import WeightVersions


class PipelineError(RuntimeError):
    """An action failed; the message names the stage, the action and the last actions run."""


class StageExecutor:
    def __init__(self, module: torch.nn.Module, versions: WeightVersions, updater: GradientUpdater,
                 p2p: PipelineP2P | None, stage: int, stages: int, microbatches: int,
                 timers=None, memory=None, on_step: Callable[[StepResult], None] | None = None):
        self.module, self.versions, self.updater, self.p2p = module, versions, updater, p2p
        # interleaved: the rank's model chunks (virtual stages chunk * p + stage), else the module
        self.chunks = list(getattr(module, "chunks", [module]))
        self.stage, self.stages, self.m = stage, stages, microbatches
        self.first, self.last = stage == 0, stage == stages - 1
        self.timers, self.memory, self.on_step = timers, memory, on_step
        self.history: collections.deque = collections.deque(maxlen=12)
        self._inputs: dict[int, torch.Tensor] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self._grads_in: dict[int, torch.Tensor] = {}
        self._grads_out: dict[int, torch.Tensor] = {}
        self._tokens: dict = {}  # last stage: microbatch -> tokens its loss covers (per-token loss)
        self._comm: list[S.Action] = []
        self._batches: dict[int, dict] = {}  # chunks: microbatch k until its last chunk's forward
        self._pending_weights: dict = {}  # split backward: (chunk, k) -> what its W needs
        self.pipemare = None  # PipeMare (pipeline/pipemare.py): backwards read the newest weights

    def _timer(self, name):
        return self.timers(name) if self.timers is not None else _NoTimer()

    def describe_history(self) -> str:
        return ", ".join(str(a) for a in self.history) or "(none)"

    # -- the loop --------------------------------------------------------------------------
    def run(self, actions: Iterable[S.Action], next_microbatch: Callable[[int], dict]) -> None:
        """Execute actions in order; consecutive transfers are posted together, as one batch."""
        self.module.train()
        for action in actions:
            try:
                if action.kind in S.COMM_KINDS:
                    self._comm.append(action)
                    continue
                self._flush_comm()
                self.history.append(action)
                self._run_one(action, next_microbatch)
            except PipelineError:
                raise
            except Exception as error:  # noqa: BLE001 - re-raised with the schedule position
                raise PipelineError(f"stage {self.stage} failed at {action}: {error}; last actions: "
                                    f"{self.describe_history()}") from error
        try:
            self._flush_comm()
            if self.p2p is not None:
                self.p2p.wait_sends()
        except Exception as error:  # noqa: BLE001
            raise PipelineError(f"stage {self.stage} failed draining transfers: {error}; last "
                                f"actions: {self.describe_history()}") from error

    def _run_one(self, a: S.Action, next_microbatch) -> None:
        if a.kind == S.FORWARD:
            self._forward(a, self._microbatch(a, next_microbatch))
        elif a.kind == S.BACKWARD:
            self.updater.finish_data_reductions()  # a fixed point in every rank's schedule
            self._before_weight_gradients(a)
            self._backward(a)
        elif a.kind == S.BACKWARD_INPUT:
            self.updater.finish_data_reductions()
            self._backward_input(a)
        elif a.kind == S.BACKWARD_WEIGHT:
            self.updater.finish_data_reductions()
            self._before_weight_gradients(a)
            self._backward_weight(a)
        elif a.kind == S.REDUCE_GRADS:
            self.updater.reduce(a.batch, self.m)
        elif a.kind == S.STEP:
            result = self.updater.step(a.batch)
            if self.on_step is not None:
                self.on_step(result)
        elif a.kind == S.RELEASE_VERSION:
            self.versions.release(a.version)
        else:
            raise ValueError(f"unknown action kind {a.kind!r}")

    def _before_weight_gradients(self, a: S.Action) -> None:
        """Tell the updater a pass accumulating weight gradients comes (a whole backward, or W of
        a split one; B accumulates none): a batch has one per microbatch and chunk, and before
        its last the bucket-by-bucket data-parallel reduction is armed."""
        self.updater.before_backward(a.microbatch // self.m, self.m * len(self.chunks))

    def _flush_comm(self) -> list[S.Action]:
        """Post the transfers gathered since the last compute as one exchange (what
        pipeline/nccl_replay.py replays as one batch); return them."""
        if not self._comm:
            return []
        batch, self._comm = self._comm, []
        self.history.extend(batch)
        sends = [("act", self._outputs[_key(a)].detach()) if a.kind == S.SEND_ACT
                 else ("grad", self._grads_out.pop(_key(a)))
                 for a in batch if a.kind in (S.SEND_ACT, S.SEND_GRAD)]
        recv_actions = [a for a in batch if a.kind in (S.RECV_ACT, S.RECV_GRAD)]
        send_actions = [a for a in batch if a.kind in (S.SEND_ACT, S.SEND_GRAD)]
        labels = [(a.microbatch, self._sender_chunk(a)) for a in send_actions + recv_actions]
        timer = self._timer("p2p-wait")
        timer.start()
        try:
            received = self.p2p.exchange(sends, ["act" if a.kind == S.RECV_ACT else "grad"
                                                 for a in recv_actions], labels)
        except Exception as error:  # noqa: BLE001 - name the transfer that failed
            names = ", ".join(str(a) for a in batch)
            raise PipelineError(f"stage {self.stage} failed in transfer [{names}]: {error}; last "
                                f"actions: {self.describe_history()}") from error
        finally:
            timer.stop()
        for a, tensor in zip(recv_actions, received):
            if a.kind == S.RECV_ACT:
                self._inputs[_key(a)] = tensor.requires_grad_()
            else:
                self._grads_in[_key(a)] = tensor
        return batch

    def _sender_chunk(self, a: S.Action) -> int:
        """The chunk whose output a transfer carries (a receive's: its sender's)."""
        if a.kind in (S.RECV_ACT, S.RECV_GRAD):
            return S.transfer_peer(self.stage, a.kind, a.chunk, self.stages)[2]
        return a.chunk

    # -- compute ---------------------------------------------------------------------------
    def _is_first(self, a: S.Action) -> bool:
        """Whether a's chunk is the first virtual stage (it embeds; it has no input gradient)."""
        return self.first and a.chunk == 0

    def _is_last(self, a: S.Action) -> bool:
        return self.last and a.chunk == len(self.chunks) - 1

    def _microbatch(self, a: S.Action, next_microbatch) -> dict:
        """Microbatch k's data: every chunk reads it; chunk 0's forward of k comes first."""
        if len(self.chunks) == 1:
            return next_microbatch(a.microbatch)
        if a.chunk == 0:
            self._batches[a.microbatch] = next_microbatch(a.microbatch)
        if a.chunk == len(self.chunks) - 1:
            return self._batches.pop(a.microbatch)
        return self._batches[a.microbatch]

    def _forward(self, a: S.Action, batch: dict) -> None:
        timer = self._timer("forward")
        timer.start()
        self.versions.install(a.version)
        key = _key(a)
        inputs = self._inputs.get(key)
        with self._track(key, inputs, batch, a):
            out = self.chunks[a.chunk](inputs, batch)
        tokens = 1
        if self.updater.per_token_loss:  # every stage reads the microbatch, so counts alike
            tokens = self.module.loss_tokens(batch)
            if a.chunk == 0:  # once per microbatch
                self.updater.record_tokens(a.microbatch // self.m, tokens)
        if self._is_last(a):
            loss, metrics = out
            self._outputs[key] = loss
            self._tokens[key] = tokens
            self.updater.record_metrics(a.microbatch // self.m, metrics, tokens)
        else:
            self._outputs[key] = out
        timer.stop()

    def _output_and_gradient(self, a: S.Action) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What a backward differentiates: the chunk's output and the gradient that came for it
        (the last stage: the loss, scaled and weighted, and None)."""
        key, k = _key(a), a.microbatch
        output = self._outputs.pop(key)
        if self._is_last(a):
            weight = self.updater.loss_weight(self._tokens.pop(key), self.m)
            return output * (self.updater.loss_scale_for(k // self.m) * weight), None
        return output, self._grads_in.pop(key)

    def _backward(self, a: S.Action) -> None:
        timer = self._timer("backward")
        timer.start()
        key = _key(a)
        self.versions.install(a.version)  # recomputation reads the module's weights
        output, grad = self._output_and_gradient(a)
        torch.autograd.backward(output, grad_tensors=grad)
        inputs = self._inputs.pop(key, None)
        if not self._is_first(a):
            self._grads_out[key] = inputs.grad
        if self.memory is not None:
            self.memory.release(key)
        timer.stop()

    def _backward_input(self, a: S.Action) -> None:
        """B: the input gradient only (sent on at once); the weights' part waits for W."""
        timer = self._timer("backward")
        timer.start()
        key = _key(a)
        self.versions.install(a.version)
        output, grad = self._output_and_gradient(a)
        inputs = self._inputs.pop(key, None)
        weights = list(self.chunks[a.chunk].parameters())
        grad_in, self._pending_weights[key] = backward_input(output, grad, inputs, weights)
        if not self._is_first(a):
            self._grads_out[key] = grad_in
        timer.stop()

    def _backward_weight(self, a: S.Action) -> None:
        timer = self._timer("backward")
        timer.start()
        key = _key(a)
        self.versions.install(a.version)  # recomputation reads the module's weights
        backward_weight(self._pending_weights.pop(key))
        if self.memory is not None:
            self.memory.release(key)
        timer.stop()

    def _track(self, microbatch: int, inputs: torch.Tensor | None, batch: dict,
               a: S.Action | None = None):
        saved_hooks = None
        if self.pipemare is not None and a is not None:  # its delay: backward's version - forward's
            saved_hooks = self.pipemare.hooks(a.microbatch // self.m - a.version)
        if self.memory is None:
            return nullcontext() if saved_hooks is None else \
                torch.autograd.graph.saved_tensors_hooks(*saved_hooks)
        signature = (None if inputs is None else (tuple(inputs.shape), inputs.dtype),
                     tuple((key, tuple(value.shape), value.dtype)
                           for key, value in sorted(batch.items()) if torch.is_tensor(value)))
        return self.memory.track(microbatch, signature, saved_hooks)

    # -- evaluation ------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self, microbatches: int, next_microbatch: Callable[[int], dict]
                 ) -> tuple[dict, float]:
        """Forward-only pass of `microbatches` microbatches with the newest weights. The last stage
        returns its metrics summed over them and the sum's weight, the number of microbatches or
        under per-token loss their tokens (other stages ({}, 0)): the caller sums both over the
        replicas before dividing."""
        self.module.eval()
        self.versions.install(self.versions.newest)
        totals: dict[str, float] = {}
        weight = 0.0
        for a in S.forward_only_actions(self.stages, microbatches, self.stage, len(self.chunks)):
            if a.kind in S.COMM_KINDS:  # posted as in training: adjacent transfers in one batch
                self._comm.append(a)
                continue
            for sent in self._flush_comm():
                if sent.kind == S.SEND_ACT:
                    del self._outputs[_key(sent)]
            batch = self._microbatch(a, next_microbatch)
            out = self.chunks[a.chunk](self._inputs.pop(_key(a), None), batch)
            if self._is_last(a):
                tokens = float(self.module.loss_tokens(batch)) \
                    if self.updater.per_token_loss else 1.0
                weight += tokens
                for key, value in out[1].items():
                    totals[key] = totals.get(key, 0.0) + float(value) * tokens
            else:
                self._outputs[_key(a)] = out
        self._flush_comm()
        self._outputs.clear()  # the last forwards' outputs, sent
        if self.p2p is not None:
            self.p2p.wait_sends()
        self.module.train()
        return totals, weight


def _key(a: S.Action) -> tuple[int, int]:
    """What the executor keys a microbatch's tensors by: its chunk and index."""
    return a.chunk, a.microbatch


class _NoTimer:
    def start(self):
        pass

    def stop(self):
        pass

