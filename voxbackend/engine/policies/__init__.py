"""Scheduling policies, one class each (EngineConfig.policy names one; docs/scheduling.md compares them):
- online (default): streaming-aware, by how soon each listener runs out of audio;
- fcfs: arrival order, every ready window decoded at once;
- offline: arrival order, windows decoded in full batches, for batch jobs nobody listens to live;
- voxserve: VoxServe's published policy, for ablation."""
from __future__ import annotations

from voxbackend.config import EngineConfig
from voxbackend.engine.policies.base import Policy
from voxbackend.engine.policies.fcfs import FcfsPolicy
from voxbackend.engine.policies.offline import OfflinePolicy
from voxbackend.engine.policies.online import OnlinePolicy
from voxbackend.engine.policies.voxserve import VoxServePolicy

POLICY_CLASSES: dict[str, type[Policy]] = {
    "online": OnlinePolicy,
    "fcfs": FcfsPolicy,
    "offline": OfflinePolicy,
    "voxserve": VoxServePolicy,
}


def make_policy(config: EngineConfig) -> Policy:
    return POLICY_CLASSES[config.policy](config)  # config.policy is checked against config.POLICIES
