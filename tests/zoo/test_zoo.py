"""The zoo's builders train one step on float64 and bf16 copies of the same weights and load by path."""
import copy
import importlib.util
import math
import os

import pytest
import torch

import precisiondiff
from tests.zoo import ZOO

HERE = os.path.dirname(os.path.abspath(__file__))


def _step(workload, dtype):
    model = copy.deepcopy(workload.model).to(dtype)
    inputs = {k: v.to(dtype) if v.is_floating_point() else v for k, v in workload.inputs.items()}
    loss = workload.loss(model(**inputs))
    loss.backward()
    return model, float(loss.detach())


@pytest.mark.parametrize("name", sorted(ZOO))
def test_zoo_model_trains_one_step_in_bf16_and_float64(name):
    torch.manual_seed(0)
    workload = ZOO[name]()
    assert isinstance(workload, precisiondiff.Workload)
    losses = {}
    for dtype in (torch.float64, torch.bfloat16):
        model, losses[dtype] = _step(workload, dtype)
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad), f"{name}: a parameter got no gradient"
    assert math.isfinite(losses[torch.bfloat16])
    # same weights and inputs: the bf16 loss is the float64 loss up to bf16 rounding
    assert losses[torch.bfloat16] == pytest.approx(losses[torch.float64], rel=2e-2)


def test_zoo_builder_loads_from_its_file_path():
    spec = importlib.util.spec_from_file_location("zoo_models_by_path", os.path.join(HERE, "models.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    workload = module.build_gpt2()
    assert type(workload.model).__name__ == "GPT2LMHeadModel"
