"""The step's configuration, split by concern: ``TrainingConfig`` (what the step does) and
``MeasurementConfig`` (how it is measured), which ``StepConfig`` joins for a trial."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from bench.levers import is_lever
from bench.measure.config import SIMULATION_ONLY, MeasurementConfig, StepConfig, lever_fields
from bench.measure.simulate import fake_process_group
from bench.model.config import get_config
from bench.training.config import TrainingConfig
from bench.training.step import build_model, make_batch, model_step


def names(cls) -> list[str]:
    return [f.name for f in dataclasses.fields(cls)]


def test_the_step_config_is_the_training_levers_then_the_measurement_ones():
    assert names(StepConfig) == names(TrainingConfig) + names(MeasurementConfig)
    assert not set(names(TrainingConfig)) & set(names(MeasurementConfig))
    assert {f.metadata["concern"] for f in dataclasses.fields(TrainingConfig) if is_lever(f)} == {"training"}
    assert {f.metadata["concern"] for f in dataclasses.fields(MeasurementConfig)} == {"simulation", "emulation"}
    assert [f.name for f in lever_fields()] == [n for n in names(StepConfig) if n not in ("scope", "batch", "dtype")]
    assert {name for name, *_ in SIMULATION_ONLY} == set(StepConfig().of_concern("simulation"))


def test_each_concern_comes_back_on_its_own():
    step = StepConfig(ac_group=2, stack="paper", allocator_model="expandable", attention_math="skip")
    training, measurement = step.training(), step.measurement()
    assert type(training) is TrainingConfig and training.ac_group == 2
    assert type(measurement) is MeasurementConfig and measurement.stack == "paper"
    assert measurement.allocator_model == "expandable" and measurement.attention_math == "skip"
    assert StepConfig(**dataclasses.asdict(training), **dataclasses.asdict(measurement)) == step


@pytest.mark.parametrize("cls,field,value", [
    (TrainingConfig, "offload_keep", "middle"),
    (MeasurementConfig, "stack", "megatron"),
    (StepConfig, "allocator_pools", "one"),
    (StepConfig, "rope_table", "cached"),
])
def test_each_part_refuses_a_value_outside_its_choices(cls, field, value):
    with pytest.raises(ValueError, match=f"{field} must be one of .*, got '{value}'"):
        cls(**{field: value})


def test_a_check_across_the_concerns_is_the_joined_configs():
    TrainingConfig(fsdp_offload=True)
    MeasurementConfig(sim_device="cpu")
    with pytest.raises(ValueError, match="fsdp_offload with sim_device='cpu'"):
        StepConfig(fsdp_offload=True, sim_device="cpu")


def test_the_step_runs_on_the_training_levers_alone():
    """The step (``bench.training.step``) takes a ``TrainingConfig``: no measurement lever reaches it."""
    cfg = get_config("tiny-llama")
    step = StepConfig(ac_group=2, stack="paper", allocator_model="expandable").training()
    with fake_process_group(2) as group:
        model, opt = build_model(cfg, "ulysses", {}, group, step, "cpu", seed=0)
        batch = make_batch(model, 64, 1, "cpu")
        loss = model_step(model, opt, batch, step, group)
    assert torch.isfinite(loss)
