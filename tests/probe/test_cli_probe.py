"""``precisiondiff probe`` as a user runs it: formats, files, --diff and its exit codes, errors."""
from __future__ import annotations

import json

import pytest

from precisiondiff.cli import main
from precisiondiff.probe import load_card


def run(capsys, *args):
    with pytest.raises(SystemExit) as exc:
        main(list(args))
    out, err = capsys.readouterr()
    return exc.value.code, out, err


def test_json_card_on_stdout(capsys):
    code, out, err = run(capsys, "probe", "--target", "cpu/bf16", "--ops", "mul,add", "--format", "json")
    assert code == 0 and err == ""
    card = json.loads(out)
    assert card["target"] == "cpu/bf16"
    assert {f["op"] for f in card["findings"]} == {"mul", "add"}


def test_out_file_takes_its_format_from_the_suffix_and_diff_compares(capsys, tmp_path):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    code, out, _ = run(capsys, "probe", "--target", "cpu/bf16", "--ops", "add", "-o", str(a))
    assert code == 0
    assert out.startswith("numerics card: cpu/bf16") and f"card written to {a}" in out
    card = load_card(str(a))
    code, out, _ = run(capsys, "probe", "--diff", str(a), str(a))
    assert code == 0 and "0 properties differ" in out
    card.add("add", "add", "signed_zero", "non-IEEE", "-0+-0 = +0")
    card.save(str(b))
    code, out, _ = run(capsys, "probe", "--diff", str(a), str(b), "--only-differences")
    assert code == 1
    assert "1 property differs" in out
    assert [line.split()[-2:] for line in out.splitlines() if line.startswith("*")] == [["IEEE", "non-IEEE"]]
    html = tmp_path / "diff.html"
    code, _, _ = run(capsys, "probe", "--diff", str(a), str(b), "-o", str(html))
    assert code == 1 and html.read_text().count('class="differs"') == 1


@pytest.mark.parametrize("args, message", [
    (["--target", "cpu/int8"], "unknown dtype 'int8'"),
    (["--target", "cpu/bf16+autocast"], "drop '+autocast'"),
    (["--target", "cpu/bf16", "--ops", "gemm,nope"], "unknown op 'nope' in --ops"),
    (["--diff", "missing_a.json", "missing_b.json"], "cannot read card missing_a.json"),
    (["--diff", "a.json", "b.json", "--ops", "gemm"], "--diff compares two saved cards"),
    (["--import", "no_such_module_xyz"], "--import no_such_module_xyz"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    code, out, err = run(capsys, "probe", *args)
    assert code == 2
    assert err.startswith("error: ") and message in err and err.count("\n") == 1


def test_import_registers_a_custom_op(capsys, tmp_path):
    plugin = tmp_path / "my_ops.py"
    plugin.write_text(
        "import torch\n"
        "from precisiondiff.probe import register_op\n"
        "register_op('halved_exp', 'exp', lambda x: (torch.exp(x.float()) * 0.5).to(x.dtype))\n")
    try:
        code, out, _ = run(capsys, "probe", "--target", "cpu/bf16", "--import", str(plugin),
                           "--ops", "halved_exp", "--format", "json")
    finally:
        from precisiondiff.probe import unregister_op
        unregister_op("halved_exp")
    assert code == 0
    card = json.loads(out)
    worst = [f for f in card["findings"] if f["op"] == "halved_exp" and f["prop"] == "max_ulp"]
    assert worst and worst[0]["value"] > 100  # half of exp is far off exp
