"""Pipeline schedules as data: the public names of the schedule modules in one place.

Each part is its own module: the action vocabulary (actions.py), the weight-version rules
(version_rules.py), one generator per schedule (one_f_one_b.py, gpipe.py, zero_bubble.py,
interleaved.py) behind the registry (schedule_registry.py), the replay in time (replay.py), the
validator (validator.py) and the text picture (text_picture.py). The runtime executor, the
planner's simulator and the pictures all consume the same lists, so there is exactly one
definition of each schedule; a new schedule is a new generator module and a registry entry.

Schedules (p stages, m microbatches per batch, batches numbered from 0):
- "2bw"   PipeDream-2BW: one 1F1B sequence over all microbatches of all batches (stage r runs p-r-1
          warm-up forwards once), never drained. Batch b uses weight version max(b-1, 0). After its
          last backward of batch b a stage reduces the batch's gradients; the step that creates
          version b+1 is deferred until that version is first needed (first forward of batch b+2) or
          the gradient buffer is needed again (reduce of batch b+1), so cross-stage decisions
          (global grad norm, fp16 overflow) complete in the background. In the segment's final
          drain, where those forwards are missing, the step keeps the slot the forward would have
          had, so the stages' steps stay in their steady-state order (the first stage's, which the
          others' wait for, before the later stages need theirs).
- "flush" PipeDream-Flush: 1F1B drained after every batch; batch b uses version b (vanilla).
- "gpipe" GPipe: all forwards of a batch, then all backwards, drained after every batch.
- "pipedream" PipeDream (weight stashing): 2BW's never-drained 1F1B sequence, but batch b on stage s
          of p uses version max(0, b - (p-1-s)): the newest version a stage has when the batch
          reaches it with one microbatch per batch (m = 1, PipeDream's own setting, allowed here),
          so stage s stashes up to p - s versions. With m > 1 a batch accumulates m microbatches
          per update under the same rule. Steps are deferred like 2BW's (until the version is
          needed or the gradient buffer is). Its step decisions (clipping norm, overflow) are each
          stage's own: a global one would stall, since stage s > 0 needs version b+1 before the
          first stage has computed its gradient of batch b (see pipeline/update.py).
- "pipedream-vs" PipeDream with vertical sync (--pipeline-schedule pipedream --vertical-sync):
          every stage uses the version the first stage uses, max(0, b - (p-1)): a uniform delay of
          p - 1 updates, so global step decisions complete in the background as under 2BW.
- "pipemare" PipeMare (pipeline/pipemare.py): 2BW's never-drained 1F1B order with ONE weight
          version per stage, stepped right after each batch's reduction: the forward of microbatch
          k reads version max(floor((k - (p-1-s)) / m), first_batch), its backward the newest,
          version k // m (the backward reads the weights at backward time; no stashing).
- "zb-h1" zero bubble (pipeline/zero_bubble.py): 1F1B with each backward split into B (input
          gradient) and W (weight gradient); W passes fill the drain. Vanilla, drained per batch.
- "interleaved" Megatron-LM's interleaved 1F1B (pipeline/interleaved.py): each rank holds `chunks`
          model chunks (virtual stages c*p + r); actions carry their chunk. Vanilla, drained.
A training run is cut into segments (at evaluation and checkpoint points); each segment is one call
with `first_batch` and `batches`, ends drained, and leaves every step of its batches done. The
weight-version rule depends only on batch indices, so segmenting never changes the arithmetic.
"""
from __future__ import annotations

from megatron_2bw.pipeline.actions import (  # noqa: F401
    BACKWARD, BACKWARD_INPUT, BACKWARD_WEIGHT, COMM_KINDS, COMPUTE_KINDS, FORWARD, LETTERS,
    RECV_ACT, RECV_GRAD, REDUCE_GRADS, RELEASE_VERSION, SEND_ACT, SEND_GRAD, STEP, Action,
    ScheduleError, end_of_flushed_batch, send_destination, stage_receives, transfer_peer,
    with_transfers)
from megatron_2bw.pipeline.forward_only import forward_only_actions  # noqa: F401
from megatron_2bw.pipeline.replay import DEFAULT_DURATIONS, TimedAction, timeline  # noqa: F401
from megatron_2bw.pipeline.schedule_registry import (  # noqa: F401
    NEVER_DRAINED, REGISTRY, SCHEDULES, ScheduleSpec, build_schedule, check_shape, max_in_flight,
    stage_actions)
from megatron_2bw.pipeline.text_picture import render  # noqa: F401
from megatron_2bw.pipeline.validator import validate  # noqa: F401
from megatron_2bw.pipeline.version_rules import (  # noqa: F401
    VersionRule, live_versions, update_delay, version_for_batch)
