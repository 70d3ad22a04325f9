"""Issue 51: one controller owns each pool's size. With the run-time planner on, an autoscaler on
either pool (the app's, or a version's) is refused at config time, naming both."""

import pytest
from pydantic import ValidationError

from cluster.config import AppConfig

SCALE = {"min_replicas": 1, "max_replicas": 4}


@pytest.mark.parametrize("pool", ["prefill", "decode"])
def test_the_planner_and_an_autoscaler_on_the_same_pool_are_refused(pool):
    with pytest.raises(ValidationError, match=rf"{pool}.autoscaling and planner.enabled both size this pool: "
                                              rf"the planner owns both pools' sizes while it is on"):
        AppConfig.model_validate({"planner": {"enabled": True}, pool: {"autoscaling": SCALE}})
    alone = AppConfig.model_validate({pool: {"autoscaling": SCALE}})  # the planner off: the autoscaler owns it
    assert getattr(alone, pool).autoscaling.max_replicas == 4
    planned = AppConfig.model_validate({"planner": {"enabled": True}})  # the planner alone
    assert planned.planner.enabled and getattr(planned, pool).autoscaling is None


def test_a_version_s_autoscaler_is_refused_under_the_planner_too():
    doc = {"planner": {"enabled": True}, "models": {"m": {"versions": {
        "v1": {"model": "/x"}, "v2": {"model": "/x", "decode": {"autoscaling": SCALE}}}}}}
    with pytest.raises(ValidationError, match=r"models.m.versions.v2.decode.autoscaling and planner.enabled both"):
        AppConfig.model_validate(doc)
