"""FSDP2's ``fully_shard`` swaps each module's class for a generated ``FSDP<Class>``: capture
records the class the user wrote, so a sharded job aligns with the same model unsharded."""
import subprocess
import sys
import textwrap

import precisiondiff
from precisiondiff.capture.hooks import class_name

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist
    from torch import nn
    from torch.distributed.fsdp import fully_shard
    import precisiondiff

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2])
    dist.init_process_group("gloo", rank=0, world_size=1)
    for sharded in (False, True):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
        if sharded:
            fully_shard(model[0]); fully_shard(model[2]); fully_shard(model)
            assert type(model[0]).__name__ == "FSDPLinear"
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
        with precisiondiff.capture(os.path.join(sys.argv[1], "fsdp" if sharded else "plain"),
                                   model=model, level="module", mode="tensors") as cap:
            model(x).square().mean().backward()
            cap.step()
    dist.destroy_process_group()
""")


def test_generated_distributed_classes_are_named_by_the_class_they_wrap():
    from torch import nn

    class Mixin:  # what fully_shard mixes in lives in torch.distributed
        pass
    Mixin.__module__ = "torch.distributed.fsdp._fully_shard._fully_shard"
    generated = type("FSDPLinear", (Mixin, nn.Linear), {})
    m = nn.Linear(2, 2)
    m.__class__ = generated
    assert class_name(m) == "Linear"

    class FSDPLinear(nn.Linear):  # a user's own class of that name is left alone
        pass
    assert class_name(FSDPLinear(2, 2)) == "FSDPLinear"


def test_an_fsdp2_model_aligns_with_the_same_model_unsharded(tmp_path):
    from tests.distributed.conftest import free_port

    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    res = subprocess.run([sys.executable, str(script), str(tmp_path), str(free_port())],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    fsdp, plain = precisiondiff.load(tmp_path / "fsdp"), precisiondiff.load(tmp_path / "plain")
    names = {(e.scope, e.name) for e in fsdp.events() if e.kind == "module"}
    assert ("0", "Linear") in names and not any(n.startswith("FSDP") for _, n in names)
    result = precisiondiff.compare(tmp_path / "fsdp", tmp_path / "plain")
    modules = [r for r in result.rows if r.kind == "module"]
    assert modules and all(r.verdict != "unmatched" for r in modules)
