"""The HPA's arithmetic under KEDA (overlays/keda), at every size from 1 to 64: why the ``keda``
backend is not exact at 10 pods and more with the default tolerance, and is with tolerance 0.

KEDA's metrics-api trigger with ``metricType: AverageValue`` and ``targetValue: 1`` is an
external metric with a per-pod target; the HPA controller's replica calculator
(kubernetes pkg/controller/podautoscaler/replica_calculator.go,
GetExternalPerPodMetricReplicas) computes, from the metric's value ``usage`` (here the
desired size) and the Deployment's current replicas:

    usageRatio = usage / (targetPerPod * currentReplicas)
    if the ratio is within tolerance: keep currentReplicas
    else: replicas = ceil(usage / targetPerPod)

"within tolerance" is ``1 - down <= usageRatio <= 1 + up``, 0.1 each by default (the
kube-controller-manager's --horizontal-pod-autoscaler-tolerance), or the HPA behavior's
``tolerance`` per direction where the HPAConfigurableTolerance gate is on.  KEDA passes
the value in milli-units (1 -> 1000m), which the ratio cancels.  0 <-> 1 is KEDA's own
activation, outside the HPA, so sizes start at 1.
"""

from __future__ import annotations

import math
from fractions import Fraction
from pathlib import Path

import yaml

SIZES = range(1, 65)
KEDA = Path(__file__).resolve().parents[2] / "infra" / "k8s" / "overlays" / "keda" / "keda.yaml"


def hpa_replicas(current: int, desired: int, *, up: Fraction, down: Fraction, target_milli: int = 1000) -> int:
    """What the HPA sets the Deployment to, for the metric value ``desired`` (exact fractions: no float edge)."""
    usage_milli = desired * 1000
    ratio = Fraction(usage_milli, target_milli * current)
    if 1 - down <= ratio <= 1 + up:
        return current
    return math.ceil(Fraction(usage_milli, target_milli))


def swallowed(tolerance: Fraction) -> list[tuple[int, int]]:
    return [(c, d) for c in SIZES for d in SIZES if hpa_replicas(c, d, up=tolerance, down=tolerance) != d]


def test_the_default_10_percent_tolerance_ignores_every_one_pod_step_from_10_pods_on() -> None:
    missed = swallowed(Fraction(1, 10))
    assert (10, 9) in missed and (10, 11) in missed and (16, 15) in missed and (64, 63) in missed
    # Exactly the changes of at most a tenth of the current size, and no other.
    assert missed == [(c, d) for c in SIZES for d in SIZES if d != c and abs(d - c) * 10 <= c]
    # Below 10 pods every change is applied: the claim the docs make for small fleets.
    assert all(c >= 10 for c, _ in missed)


def test_tolerance_zero_applies_every_decision_exactly_at_every_size() -> None:
    assert swallowed(Fraction(0)) == []


def test_the_keda_overlay_asks_for_tolerance_zero_in_both_directions_with_target_one() -> None:
    for so in (d for d in yaml.safe_load_all(KEDA.read_text()) if d["kind"] == "ScaledObject"):
        behavior = so["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
        up, down = Fraction(behavior["scaleUp"]["tolerance"]), Fraction(behavior["scaleDown"]["tolerance"])
        trigger = so["spec"]["triggers"][0]
        assert trigger["metricType"] == "AverageValue" and trigger["metadata"]["targetValue"] == "1"
        assert all(hpa_replicas(c, d, up=up, down=down) == d for c in SIZES for d in SIZES)
