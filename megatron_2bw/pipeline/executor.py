"""Runs one stage's schedule actions with real tensors: one loop, one branch per action kind.

The same action lists drive the validator, the planner's simulator and the schedule picture.
"""
from __future__ import annotations

import collections
from contextlib import nullcontext
from typing import Callable, Iterable

import torch

from megatron_2bw.distributed.p2p import PipelineP2P
from megatron_2bw.pipeline import schedules as S
from megatron_2bw.pipeline.update import GradientUpdater, StepResult
from megatron_2bw.pipeline.weights import WeightVersions


class PipelineError(RuntimeError):
    """An action failed; the message names the stage, the action and the last actions run."""


class StageExecutor:
    def __init__(self, module: torch.nn.Module, versions: WeightVersions, updater: GradientUpdater,
                 p2p: PipelineP2P | None, stage: int, stages: int, microbatches: int,
                 timers=None, memory=None, on_step: Callable[[StepResult], None] | None = None):
        self.module, self.versions, self.updater, self.p2p = module, versions, updater, p2p
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

    def _timer(self, name):
        return self.timers(name) if self.timers is not None else _NoTimer()

    def describe_history(self) -> str:
        return ", ".join(str(a) for a in self.history) or "(none)"

    # -- the loop --------------------------------------------------------------------------
    def run(self, actions: Iterable[S.Action], next_microbatch: Callable[[int], dict],
            receives: dict[str, int] | None = None) -> None:
        """Execute actions in order; consecutive transfers are posted together. `receives`
        (schedules.stage_receives of the segment) lets the transfers post receives ahead."""
        self.module.train()
        if self.p2p is not None and receives is not None:
            self.p2p.expect(receives)
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
            self._forward(a, next_microbatch(a.microbatch))
        elif a.kind == S.BACKWARD:
            self.updater.finish_data_reductions()  # a fixed point in every rank's schedule
            self.updater.before_backward(a.microbatch // self.m, self.m)
            self._backward(a)
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

    def _flush_comm(self) -> None:
        if not self._comm:
            return
        batch, self._comm = self._comm, []
        self.history.extend(batch)
        sends = [("act", self._outputs[a.microbatch].detach()) if a.kind == S.SEND_ACT
                 else ("grad", self._grads_out.pop(a.microbatch))
                 for a in batch if a.kind in (S.SEND_ACT, S.SEND_GRAD)]
        recv_actions = [a for a in batch if a.kind in (S.RECV_ACT, S.RECV_GRAD)]
        timer = self._timer("p2p-wait")
        timer.start()
        try:
            received = self.p2p.exchange(sends, ["act" if a.kind == S.RECV_ACT else "grad"
                                                 for a in recv_actions])
        except Exception as error:  # noqa: BLE001 - name the transfer that failed
            names = ", ".join(str(a) for a in batch)
            raise PipelineError(f"stage {self.stage} failed in transfer [{names}]: {error}; last "
                                f"actions: {self.describe_history()}") from error
        finally:
            timer.stop()
        for a, tensor in zip(recv_actions, received):
            if a.kind == S.RECV_ACT:
                self._inputs[a.microbatch] = tensor.requires_grad_()
            else:
                self._grads_in[a.microbatch] = tensor

    # -- compute ---------------------------------------------------------------------------
    def _forward(self, a: S.Action, batch: dict) -> None:
        timer = self._timer("forward")
        timer.start()
        self.versions.install(a.version)
        inputs = self._inputs.get(a.microbatch)
        with self._track(a.microbatch, inputs, batch):
            out = self.module(inputs, batch)
        tokens = 1
        if self.updater.per_token_loss:  # every stage reads the microbatch, so counts alike
            tokens = self.module.loss_tokens(batch)
            self.updater.record_tokens(a.microbatch // self.m, tokens)
        if self.last:
            loss, metrics = out
            self._outputs[a.microbatch] = loss
            self._tokens[a.microbatch] = tokens
            self.updater.record_metrics(a.microbatch // self.m, metrics, tokens)
        else:
            self._outputs[a.microbatch] = out
        timer.stop()

    def _backward(self, a: S.Action) -> None:
        timer = self._timer("backward")
        timer.start()
        k = a.microbatch
        self.versions.install(a.version)  # recomputation reads the module's weights
        output = self._outputs.pop(k)
        if self.last:
            weight = self.updater.loss_weight(self._tokens.pop(k), self.m)
            (output * (self.updater.loss_scale_for(k // self.m) * weight)).backward()
        else:
            torch.autograd.backward(output, grad_tensors=self._grads_in.pop(k))
        inputs = self._inputs.pop(k, None)
        if not self.first:
            self._grads_out[k] = inputs.grad
        if self.memory is not None:
            self.memory.release(k)
        timer.stop()

    def _track(self, microbatch: int, inputs: torch.Tensor | None, batch: dict):
        if self.memory is None:
            return nullcontext()
        signature = (None if inputs is None else (tuple(inputs.shape), inputs.dtype),
                     tuple((key, tuple(value.shape), value.dtype)
                           for key, value in sorted(batch.items()) if torch.is_tensor(value)))
        return self.memory.track(microbatch, signature)

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
        if self.p2p is not None:
            self.p2p.expect({"act": 0 if self.first else microbatches})
        for a in S.forward_only_actions(self.stages, microbatches, self.stage):
            if a.kind == S.RECV_ACT:
                self._inputs[a.microbatch] = self.p2p.exchange([], ["act"])[0]
            elif a.kind == S.SEND_ACT:
                self.p2p.exchange([("act", self._outputs.pop(a.microbatch))], [])
            else:
                batch = next_microbatch(a.microbatch)
                out = self.module(self._inputs.pop(a.microbatch, None), batch)
                if self.last:
                    tokens = float(self.module.loss_tokens(batch)) \
                        if self.updater.per_token_loss else 1.0
                    weight += tokens
                    for key, value in out[1].items():
                        totals[key] = totals.get(key, 0.0) + float(value) * tokens
                else:
                    self._outputs[a.microbatch] = out
        if self.p2p is not None:
            self.p2p.wait_sends()
        self.module.train()
        return totals, weight


class _NoTimer:
    def start(self):
        pass

    def stop(self):
        pass

