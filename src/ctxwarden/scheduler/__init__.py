"""Scheduling (no torch): continuous batching, chunked prefill, preemption."""

from ctxwarden.scheduler.policy import PreemptionCost, choose_preemption_mode
from ctxwarden.scheduler.scheduler import (Preemption, ScheduledSeq, Scheduler, SchedulerConfig,
                                           SchedulerOutput, SchedulerStats, SwapIn)

__all__ = ["Preemption", "PreemptionCost", "ScheduledSeq", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SchedulerStats", "SwapIn", "choose_preemption_mode"]
