"""The method registry: each built-in method states what it is; lookups and registration."""

from __future__ import annotations

import pytest

from ncgrpo.core.plan import plan_rows
from ncgrpo.methods import (
    RolloutMethod,
    get_method,
    method_names,
    methods,
    register_method,
    unregister_method,
)


def test_the_built_ins_in_the_papers_order():
    assert method_names()[:7] == (
        "vanilla",
        "latent",
        "image",
        "antithetic",
        "spsa",
        "first_token_temperature",
        "first_token_marginal",
    )


def test_what_each_built_in_is():
    facts = {
        m.name: (m.two_pass, m.paired, m.key_rule, m.noise_mode, m.uses_sigma, m.marginal)
        for m in methods()
        if m.name in method_names()[:7]
    }
    assert facts == {
        "vanilla": (False, False, "none", None, False, None),
        "latent": (True, False, "row", "independent", True, "draws"),
        "image": (True, False, "prompt", None, False, None),
        "antithetic": (True, True, "pair", "antithetic", True, "draws"),
        "spsa": (True, True, "pair", "rank_one", True, "draws"),
        "first_token_temperature": (True, False, "none", None, False, "temperature"),
        "first_token_marginal": (True, False, "row", None, True, "draws"),
    }
    refused_on_verl = {m.name for m in methods()[:7] if m.verl_refusal}
    assert refused_on_verl == {"image", "spsa", "first_token_marginal"}
    assert {m.name for m in methods()[:7] if m.probe_refusal is None} == {"latent", "antithetic", "spsa"}


def test_unknown_names_list_the_registered_ones():
    with pytest.raises(ValueError, match="rollout_method='gaussian' is unknown; use one of vanilla, latent"):
        get_method("gaussian")
    assert get_method(get_method("latent")) is get_method("latent")


def test_group_size_is_checked_in_one_place():
    get_method("vanilla").check_group_size(3)
    with pytest.raises(ValueError, match="num_generations must be even; got 3"):
        get_method("latent").check_group_size(3)
    with pytest.raises(ValueError, match="a multiple of 4; got 6"):
        get_method("spsa").check_group_size(6)
    with pytest.raises(ValueError, match="rollout.n must be even"):
        get_method("image").check_group_size(5, field="rollout.n")


def test_registering_a_method_and_its_refusals():
    @register_method
    class Toy(RolloutMethod):
        name = "toy_registry_test"
        key_rule = "row"
        noise_mode = "independent"
        uses_sigma = True
        probe_refusal = None

    try:
        toy = get_method("toy_registry_test")
        assert isinstance(toy, Toy) and "toy_registry_test" in method_names()
        plans = plan_rows(range(4), [7] * 4, num_generations=4, method=toy, seed=1, step=2)
        assert [p.noisy for p in plans] == [False, False, True, True]
        assert toy.row_noise(plans[3], 0.3).sigma == 0.3
        with pytest.raises(NotImplementedError, match="on verl"):
            toy.verl_extra_args(None, plans[3], 1, 1.0)
        with pytest.raises(ValueError, match="registered already"):

            @register_method
            class Other(RolloutMethod):
                name = "toy_registry_test"
    finally:
        unregister_method("toy_registry_test")
    assert "toy_registry_test" not in method_names()
    with pytest.raises(ValueError, match="Python identifier"):

        @register_method
        class Bad(RolloutMethod):
            name = "not a name"


def test_one_baseline_and_help_lines_from_the_registry():
    """Every list of method names in a help string is the registry's (issue 45): the trainer's
    rollout_method help holds each registered method's help line, and exactly one method is the baseline
    (the demo's first row and the model card's plain GRPO line)."""
    from dataclasses import fields

    from ncgrpo.methods import baseline_method, method_help, methods
    from ncgrpo.toy.demo_config import DemoConfig
    from ncgrpo.trainer.config import NCGRPOConfig

    assert [m.name for m in methods() if m.baseline] == [baseline_method().name] == ["vanilla"]
    help_text = next(f for f in fields(NCGRPOConfig) if f.name == "rollout_method").metadata["help"]
    assert method_help() in help_text
    for m in methods():
        assert m.help_line in help_text and m.summary in m.help_line
    spec = DemoConfig(output_dir="/nonexistent-demo").methods()[0]
    assert (spec.rollout_method, spec.slug) == (baseline_method().name, baseline_method().slug)


def test_method_state_is_the_methods_and_an_existing_state_file_loads(tmp_path):
    """SPSA's mu and the control's T0 live in the state object the method creates (issue 45), and an
    ncgrpo_state.pt in the layout checkpoints have always had loads into it."""
    from types import SimpleNamespace

    import torch

    from ncgrpo.methods import get_method

    spsa, control = get_method("spsa"), get_method("first_token_temperature")
    tr = SimpleNamespace(hidden_size=lambda: 3, args=SimpleNamespace(first_token_temperature_auto=True))
    tr.nc_state = spsa.init_state(tr)
    assert torch.equal(tr.nc_state.mu, torch.zeros(3))
    path = tmp_path / "ncgrpo_state.pt"
    torch.save(
        {"rollout_method": "spsa", "spsa_mu": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)}, path
    )
    spsa.load_state_dict(tr, str(path))
    assert tr.nc_state.mu.dtype == torch.float32 and tr.nc_state.mu.tolist() == [1.0, 2.0, 3.0]
    assert spsa.state_dict(tr)["spsa_mu"] is tr.nc_state.mu

    tr.nc_state = control.init_state(tr)
    assert tr.nc_state.t0 is None and control.state_dict(tr) == {"first_token_temperature_t0": None}
    torch.save({"rollout_method": "first_token_temperature", "first_token_temperature_t0": 1.25}, path)
    control.load_state_dict(tr, str(path))
    assert tr.nc_state.t0 == 1.25 and control.t0(tr) == 1.25
    assert get_method("latent").init_state(tr) is None


def test_methods_read_only_what_the_trainer_view_names():
    """Every ``tr.<name>`` in ncgrpo.methods is a member of the TrainerView protocol, and every hook
    that takes the trainer types it with it (issue 45): what a method may use of the trainer is
    declared in one place."""
    import re
    from pathlib import Path

    import ncgrpo.methods
    from ncgrpo.methods.base import TrainerView

    allowed = {n for n in dir(TrainerView) if not n.startswith("_")} | set(TrainerView.__annotations__)
    used, untyped = set(), []
    for path in Path(ncgrpo.methods.__file__).parent.glob("*.py"):
        text = path.read_text()
        used |= set(re.findall(r"\btr\.([A-Za-z_]\w*)", text))
        untyped += [
            f"{path.name}: {m}" for m in re.findall(r"def \w+\([^)]*\btr\b(?!: TrainerView)[^)]*\)", text)
        ]
    assert used and used <= allowed, (
        f"methods read trainer attributes outside TrainerView: {sorted(used - allowed)}"
    )
    assert not untyped, untyped
