"""hf:PATH workloads: tiny transformers configs and checkpoints written by the tests, no download."""
from __future__ import annotations

import json
import os

import pytest
import torch

from precisiondiff.errors import WorkloadError
from precisiondiff.runtime.workload import load_workload

transformers = pytest.importorskip("transformers")

from click.testing import CliRunner  # noqa: E402

from precisiondiff.cli import cli  # noqa: E402


def _llama_config(**kw):
    return transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                    bos_token_id=1, eos_token_id=2, **kw)


@pytest.fixture(scope="module")
def llama_checkpoint(tmp_path_factory):
    """A save_pretrained directory: config.json and model.safetensors (weights seeded 123)."""
    path = tmp_path_factory.mktemp("hf") / "tiny-llama"
    torch.manual_seed(123)
    transformers.LlamaForCausalLM(_llama_config()).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def gpt2_config(tmp_path_factory):
    path = tmp_path_factory.mktemp("hf") / "gpt2"
    transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                            bos_token_id=1, eos_token_id=2).save_pretrained(path)
    return path


def test_a_checkpoint_loads_its_own_weights_with_causal_lm_labels(llama_checkpoint):
    from safetensors.torch import load_file
    w = load_workload(f"hf:{llama_checkpoint}", seed=0)
    assert type(w.model).__name__ == "LlamaForCausalLM" and w.name == f"hf:{llama_checkpoint}"
    saved = load_file(llama_checkpoint / "model.safetensors")
    state = w.model.state_dict()
    assert saved and all(torch.equal(state[k], v.float()) for k, v in saved.items())
    ids = w.inputs["input_ids"]
    assert ids.shape == (2, 16) and ids.dtype == torch.long and 0 <= int(ids.min()) and int(ids.max()) < 64
    assert torch.equal(w.inputs["labels"], ids) and w.inputs["attention_mask"].eq(1).all()
    assert w.model.config._attn_implementation == "eager"
    loss = w.loss(w.model(**w.inputs))
    assert loss.ndim == 0 and torch.isfinite(loss)


def test_a_config_gives_seeded_random_weights_the_same_for_every_load(gpt2_config):
    a = load_workload(f"hf:{gpt2_config}", seed=0)
    b = load_workload(f"hf:{gpt2_config / 'config.json'}", seed=0)  # the JSON file itself works too
    c = load_workload(f"hf:{gpt2_config}", seed=1)
    assert type(a.model).__name__ == "GPT2LMHeadModel"
    wa, wb, wc = (m.model.transformer.h[0].attn.c_attn.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    assert torch.equal(a.inputs["input_ids"], b.inputs["input_ids"])
    assert not torch.equal(a.inputs["input_ids"], c.inputs["input_ids"])


def test_a_local_tokenizer_encodes_the_example_text(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from precisiondiff.runtime.hf import EXAMPLE_TEXT
    words = sorted({w for t in EXAMPLE_TEXT for w in t.replace(",", " ").replace(".", " ").split()})
    vocab = {"[UNK]": 0, "[PAD]": 1, **{w: i + 2 for i, w in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]")
    fast.save_pretrained(tmp_path)
    _llama_config().save_pretrained(tmp_path)
    w = load_workload(f"hf:{tmp_path}")
    expected = [vocab.get(x, 0) for x in "The quick brown fox jumps over the lazy dog".split()]
    assert w.inputs["input_ids"][0, :len(expected)].tolist() == expected
    assert w.inputs["input_ids"].shape == (2, 16)  # truncated to seq_len


def test_loading_is_offline_and_local_only(llama_checkpoint, monkeypatch):
    seen = {}
    real = transformers.LlamaForCausalLM.from_pretrained.__func__

    def spy(cls, *args, **kwargs):
        seen.update(offline=os.environ.get("HF_HUB_OFFLINE"), local=kwargs.get("local_files_only"))
        return real(cls, *args, **kwargs)
    monkeypatch.setattr(transformers.LlamaForCausalLM, "from_pretrained", classmethod(spy))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    load_workload(f"hf:{llama_checkpoint}")
    assert seen == {"offline": "1", "local": True}
    assert "HF_HUB_OFFLINE" not in os.environ  # restored afterwards


def test_a_classification_head_gets_its_own_loss(tmp_path):
    _llama_config(architectures=["LlamaForSequenceClassification"], num_labels=3).save_pretrained(tmp_path)
    w = load_workload(f"hf:{tmp_path}")
    assert type(w.model).__name__ == "LlamaForSequenceClassification"
    assert w.inputs["labels"].tolist() == [0, 0]
    out = w.model(**w.inputs)
    assert out.logits.shape == (2, 3) and torch.isfinite(w.loss(out))


@pytest.mark.parametrize("content, message", [
    (None, "no such file or directory"),
    ({}, "no config.json there"),
    ({"config.json": {"hidden_size": 4}}, "has no model_type"),
    ({"config.json": {"model_type": "no-such-model"}}, "is not known to transformers"),
])
def test_bad_paths_are_one_line_errors(tmp_path, content, message):
    path = tmp_path / "ckpt"
    if content is not None:
        path.mkdir()
        for name, obj in content.items():
            (path / name).write_text(json.dumps(obj))
    with pytest.raises(WorkloadError, match=message):
        load_workload(f"hf:{path}")


def test_capture_an_hf_checkpoint_from_the_cli(llama_checkpoint, tmp_path):
    runner = CliRunner()
    dut = runner.invoke(cli, ["capture", f"hf:{llama_checkpoint}", "-o", str(tmp_path / "dut"), "--level", "module"])
    assert dut.exit_code == 0, dut.output
    assert f"of hf:{llama_checkpoint} on cpu/bf16" in dut.stdout and "loss" in dut.stdout
    import precisiondiff
    scopes = {ev.scope for ev in precisiondiff.load(tmp_path / "dut").events()}
    assert {"model.layers.0.self_attn", "lm_head"} <= scopes
    bad = runner.invoke(cli, ["capture", f"hf:{tmp_path / 'missing'}", "-o", str(tmp_path / "x")])
    assert bad.exit_code == 2 and bad.stderr.count("\n") == 1 and "no such file" in bad.stderr


def test_the_pytest_plugin_checks_an_hf_workload(pytester, llama_checkpoint):
    pytester.makepyfile(test_it=f"""
def test_llama(parity):
    r = parity.check("hf:{llama_checkpoint}", expect=False)
    assert r.name == "hf:{llama_checkpoint}"
    keys = [c.key for c in r.checks]
    assert "loss" in keys and any(k.startswith("grad") for k in keys), keys
""")
    result = pytester.runpytest("-p", "no:cacheprovider", "--parity-target", "cpu/bf16")
    result.assert_outcomes(passed=1)
