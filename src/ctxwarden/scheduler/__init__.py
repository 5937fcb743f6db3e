"""Scheduling (no torch): continuous batching, chunked prefill, preemption."""

from ctxwarden.scheduler.policy import PreemptionCost, choose_preemption_mode
from ctxwarden.scheduler.scheduler import (Preemption, ScheduledSeq, Scheduler, SchedulerConfig,
                                           SchedulerOutput, SchedulerStats, SwapIn)
from ctxwarden.scheduler.tiering import FetchedPrefix, TierFill

__all__ = ["FetchedPrefix", "TierFill", "Preemption", "PreemptionCost", "ScheduledSeq", "Scheduler", "SchedulerConfig",
           "SchedulerOutput", "SchedulerStats", "SwapIn", "choose_preemption_mode"]
