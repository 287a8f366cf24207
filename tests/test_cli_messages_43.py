"""Messages a new user met (issue 43's hostile pass): no flag matched by a prefix of its name (a
did-you-mean error instead), repeated probe sigmas, register_method given what is not a RolloutMethod
subclass, sigma_max's bound."""

from __future__ import annotations

import pytest

from ncgrpo.cli import main


@pytest.mark.parametrize(
    "argv, said",
    [
        (["--deb", "compare"], "unrecognized arguments: --deb (did you mean '--debug'?)"),
        (["--vers"], "unrecognized arguments: --vers (did you mean '--version'?)"),
        (["trian"], "invalid choice: 'trian'"),
        (["compare", "--run", "a", "--baseline", "b"], "unknown option --run (did you mean '--runs'?)"),
        (["train", "--learning", "3e-4"], "unknown option --learning (did you mean '--learning_rate'?)"),
        (["probe", "--sigma_sch", "constant"], "unknown option --sigma_sch"),
        (["eval", "--model_name", "x"], "unknown option --model_name (did you mean '--model_name_or_path'?)"),
    ],
)
def test_no_flag_is_matched_by_a_prefix(argv, said, capsys) -> None:
    """``--deb`` used to mean ``--debug`` and ``--vers`` ``--version`` (argparse's prefix matching);
    ``compare --run`` said the required --runs was missing, not that --run is unknown."""
    try:
        rc = main(argv)
    except SystemExit as e:  # ncgrpo's own parser exits as argparse does
        rc = e.code
    assert rc == 2
    err = capsys.readouterr().err
    assert said in err, err
    if argv == ["trian"]:
        assert "did you mean 'train'?" in err


@pytest.mark.parametrize("sigmas", [["0.2", "0.2"], ["0", "0"], ["0", "0.5", "0.50"]])
def test_probe_refuses_a_repeated_sigma(sigmas, capsys) -> None:
    """It used to end in "internal error: IndexError" after the model loaded."""
    assert main(["probe", "--sigma0", *sigmas]) == 2
    err = capsys.readouterr().err
    assert "ncgrpo probe: error: --sigma0 gives" in err and "twice" in err, err


def test_the_probe_library_refuses_a_repeated_sigma() -> None:
    from ncgrpo.data.types import Question
    from ncgrpo.eval.probe import _check_settings
    from ncgrpo.methods import get_method

    with pytest.raises(ValueError, match="sigma 0.2 is given twice"):
        _check_settings(
            [Question("mine", "q1", "What is 2 + 3?", "5")],
            [0.2, 0.2],
            rollouts=2,
            site="final_norm",
            method=get_method("latent"),
            temperature=1.0,
            marginal_draws=8,
            target_marginal_tv=None,
        )


def test_register_method_refuses_what_is_not_a_rollout_method_subclass() -> None:
    from ncgrpo.methods import RolloutMethod, method_names, register_method

    class Plain:
        name = "plain_43"

    with pytest.raises(TypeError, match="not a RolloutMethod subclass"):
        register_method(Plain)
    with pytest.raises(TypeError, match="class decorator.*got the str 'latent'"):
        register_method("latent")
    with pytest.raises(ValueError, match="Nameless: a rollout method needs a class attribute name"):

        @register_method
        class Nameless(RolloutMethod):
            pass

    assert "plain_43" not in method_names()


@pytest.mark.parametrize("value, said", [(0.0, "got 0.0"), (-1.0, "got -1.0")])
def test_sigma_max_says_it_must_be_above_zero(value, said) -> None:
    """``--sigma_max -1`` said "0 disables the noise" while ``--sigma_max 0`` is refused."""
    from ncgrpo.trainer import NCGRPOConfig

    with pytest.raises(ValueError) as e:
        NCGRPOConfig(output_dir="unused", target_marginal_tv=0.01, sigma_max=value, use_cpu=True, bf16=False)
    text = str(e.value)
    assert "sigma_max must be a finite number > 0" in text and said in text, text
    assert "disables the noise" not in text
