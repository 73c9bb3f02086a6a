"""The problem registry derives from the modules, and each module's op agrees with its problem."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from evoattn.problems import builtin_names, get_problem, has_op, module_of
from evoattn.export_package import module_name, shipped_problem_modules

ROOT = Path(__file__).resolve().parent.parent


def test_every_module_defining_problem_is_a_builtin_of_its_problems_name() -> None:
    names = builtin_names()
    assert {"sdpa", "gqa", "masked", "strided", "sliding_window", "decode", "mha",
            "model"} <= set(names)
    for name in names:
        assert module_of(name).PROBLEM.name == name and get_problem(name).name == name
        assert module_name(name) == module_of(name).__name__.rsplit(".", 1)[1]
    assert module_name("model") == "model_prefill"


def test_a_problem_in_a_module_of_another_name_ships_that_module_and_its_op() -> None:
    shipped = shipped_problem_modules("model")
    assert {"model_prefill", "model_op", "model_baselines", "op", "base"} <= set(shipped)
    assert "model" not in shipped and "sliding_window" not in shipped


def test_only_problems_whose_module_has_an_op_export_one() -> None:
    assert not has_op("mha") and get_problem("mha").no_op_reason
    for n in builtin_names():
        problem = get_problem(n)
        assert (has_op(n) and problem.op_docs and not problem.no_op_reason) or \
            (not has_op(n) and problem.no_op_reason), n
    assert not has_op("nope")


def test_a_problems_baselines_go_by_the_names_it_lists() -> None:
    for name in builtin_names():
        p = get_problem(name)
        assert set(p.baselines()) | set(p.skipped_baselines()) == set(p.baseline_names), name


def test_a_package_ships_its_problems_module_and_not_another_problems() -> None:
    shipped = shipped_problem_modules("strided")
    assert {"strided", "op", "base"} <= set(shipped)
    assert not {"sdpa", "gqa", "masked", "sliding_window", "user"} & set(shipped)
    assert "user" not in shipped_problem_modules(None)


def test_reading_the_registry_imports_no_torch() -> None:
    code = ("import sys; from evoattn.problems import builtin_names, get_problem; "
            "[get_problem(n).label(get_problem(n).cpu_configs[0]) for n in builtin_names()]; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=300)
    assert out.stdout.strip() == "False", out.stderr


@pytest.mark.parametrize("name,param", [("strided", "stride"), ("sliding_window", "window")])
def test_the_ops_fallback_masks_as_the_problems_reference_does(name: str, param: str) -> None:
    torch = pytest.importorskip("torch")
    problem = get_problem(name)
    cfg = {"B": 1, "H": 2, "S": 37, "D": 64, param: 5}
    inputs = problem.make_inputs(cfg, torch.float32, "cpu", torch.Generator().manual_seed(0))
    spec = module_of(name).op_spec()
    args = spec.bind((inputs["q"], inputs["k"], inputs["v"], inputs[param]), {})
    assert spec.shape_refusal(args) is None
    got = spec.fallback_for(args)(inputs["q"], inputs["k"], inputs["v"], inputs[param])
    torch.testing.assert_close(got, problem.reference(inputs, cfg), atol=1e-5, rtol=1e-5)


def test_the_alibi_ops_fallback_is_the_problems_reference() -> None:
    torch = pytest.importorskip("torch")
    problem = get_problem("alibi")
    cfg = {"B": 1, "H": 3, "S": 29, "D": 64}
    inputs = problem.make_inputs(cfg, torch.float32, "cpu", torch.Generator().manual_seed(0))
    spec = module_of("alibi").op_spec()
    values = (inputs["q"], inputs["k"], inputs["v"], inputs["slopes"])
    args = spec.bind(values, {})
    assert spec.shape_refusal(args) is None
    assert "slopes" in spec.shape_refusal(spec.bind(values[:3] + (inputs["slopes"][:2],), {}))
    torch.testing.assert_close(spec.fallback_for(args)(*values), problem.reference(inputs, cfg),
                               atol=1e-5, rtol=1e-5)
