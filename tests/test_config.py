"""Configuration: activation rules and every error, without sglang."""

from __future__ import annotations

import pytest

from sglang_oobguard.model.config import Backend, ConfigError, Mode, from_env


@pytest.mark.parametrize("value", ["1", "true", "TRUE", "Yes", "y"])
def test_async_assert_true_means_strict(value):
    assert from_env({"SGLANG_ENABLE_ASYNC_ASSERT": value}).mode is Mode.STRICT


@pytest.mark.parametrize("value", ["0", "false", "No", "n", ""])
def test_async_assert_false_or_empty_is_off(value):
    cfg = from_env({"SGLANG_ENABLE_ASYNC_ASSERT": value})
    assert cfg.mode is Mode.OFF and not cfg.active


def test_nothing_set_is_off():
    assert not from_env({}).active


@pytest.mark.parametrize("level,mode", [("1", Mode.WARN), ("2", Mode.STRICT)])
def test_invariant_level_picks_mode(level, mode):
    assert from_env({"SGLANG_INVARIANT_CHECK": level}).mode is mode
    assert from_env({"SGLANG_INVARIANT_CHECK": level, "SGLANG_ENABLE_ASYNC_ASSERT": "1"}).mode is mode


def test_invariant_zero_with_async_assert_is_strict():
    assert from_env({"SGLANG_INVARIANT_CHECK": "0", "SGLANG_ENABLE_ASYNC_ASSERT": "1"}).mode is Mode.STRICT


@pytest.mark.parametrize("mode", ["strict", "raise", "warn", "RAISE"])
def test_explicit_mode_wins(mode):
    cfg = from_env({"SGLANG_OOBGUARD_MODE": mode, "SGLANG_INVARIANT_CHECK": "1"})
    assert cfg.mode is Mode(mode.lower())


def test_off_wins_over_everything():
    env = {"SGLANG_OOBGUARD_MODE": "off", "SGLANG_ENABLE_ASYNC_ASSERT": "1", "SGLANG_INVARIANT_CHECK": "2"}
    assert not from_env(env).active


def test_numbers_and_backend_parse():
    cfg = from_env({"SGLANG_OOBGUARD_MODE": "warn", "SGLANG_OOBGUARD_BACKEND": "Triton",
                    "SGLANG_OOBGUARD_POLL_EVERY": "4", "SGLANG_OOBGUARD_WARN_INTERVAL_S": "0.5"})
    assert (cfg.backend, cfg.poll_every, cfg.warn_interval_s) == (Backend.TRITON, 4, 0.5)


@pytest.mark.parametrize(
    "variable,value,accepted",
    [
        ("SGLANG_ENABLE_ASYNC_ASSERT", "on", "true/1/yes/y"),
        ("SGLANG_ENABLE_ASYNC_ASSERT", " 1", "true/1/yes/y"),
        ("SGLANG_INVARIANT_CHECK", "3", "0 | 1 | 2"),
        ("SGLANG_INVARIANT_CHECK", "strict", "0 | 1 | 2"),
        ("SGLANG_OOBGUARD_MODE", "loud", "strict | raise | warn | off"),
        ("SGLANG_OOBGUARD_BACKEND", "cuda", "auto | torch | triton"),
        ("SGLANG_OOBGUARD_POLL_EVERY", "0", "int >= 1"),
        ("SGLANG_OOBGUARD_POLL_EVERY", "2.5", "int >= 1"),
        ("SGLANG_OOBGUARD_WARN_INTERVAL_S", "nan", "float >= 0.0"),
        ("SGLANG_OOBGUARD_WARN_INTERVAL_S", "-1", "float >= 0.0"),
        ("SGLANG_OOBGUARD_LIVENESS", "on", "true/1/yes/y"),
    ],
)
def test_every_invalid_value_names_variable_value_and_choices(variable, value, accepted):
    with pytest.raises(ConfigError) as info:
        from_env({"SGLANG_OOBGUARD_MODE": "strict", variable: value} if variable != "SGLANG_OOBGUARD_MODE"
                 else {variable: value})
    message = str(info.value)
    assert variable in message and repr(value) in message and accepted in message
    assert "NOT active" in message
    assert (info.value.variable, info.value.value) == (variable, value)


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
def test_liveness_works_in_every_mode(mode):
    cfg = from_env({"SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_LIVENESS": "1"})
    assert cfg.liveness and cfg.mode is Mode(mode)
    assert not from_env({"SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_LIVENESS": "no"}).liveness
    assert not from_env({"SGLANG_OOBGUARD_MODE": mode}).liveness


@pytest.mark.parametrize("mode", ["strict", "raise", "warn"])
def test_finite_works_in_every_mode_and_is_opt_in(mode):
    assert from_env({"SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_FINITE": "yes"}).finite
    assert not from_env({"SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_FINITE": "0"}).finite
    assert not from_env({"SGLANG_OOBGUARD_MODE": mode}).finite
    with pytest.raises(ConfigError, match="SGLANG_OOBGUARD_FINITE='nan'"):
        from_env({"SGLANG_OOBGUARD_MODE": mode, "SGLANG_OOBGUARD_FINITE": "nan"})


@pytest.mark.parametrize("variable", ["SGLANG_OOBGUARD_LIVENESS", "SGLANG_OOBGUARD_FINITE"])
def test_a_deeper_check_without_the_guard_is_an_error_naming_the_fix(variable):
    with pytest.raises(ConfigError) as info:
        from_env({variable: "1"})
    message = str(info.value)
    assert variable in message and "SGLANG_ENABLE_ASYNC_ASSERT=1" in message
    assert "NOT active" in message


@pytest.mark.parametrize("variable", ["SGLANG_OOBGUARD_LIVENESS", "SGLANG_OOBGUARD_FINITE"])
def test_explicit_off_wins_over_a_deeper_check(variable):
    cfg = from_env({"SGLANG_OOBGUARD_MODE": "off", variable: "1"})
    assert not cfg.active and not cfg.liveness and not cfg.finite


def test_install_argument_wins_and_defaults_to_strict():
    assert from_env({}, mode=Mode.WARN).mode is Mode.WARN
    assert from_env({"SGLANG_OOBGUARD_MODE": "off"}, mode=Mode.RAISE).mode is Mode.RAISE
    cfg = from_env({"SGLANG_OOBGUARD_LIVENESS": "1"}, default=Mode.STRICT)
    assert cfg.mode is Mode.STRICT and cfg.liveness
    assert not from_env({"SGLANG_OOBGUARD_MODE": "off"}, default=Mode.STRICT).active


def test_report_dir_is_made_absolute_and_empty_is_unset(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert from_env({"SGLANG_OOBGUARD_REPORT_DIR": "reports"}).report_dir == str(tmp_path / "reports")
    assert from_env({"SGLANG_OOBGUARD_REPORT_DIR": ""}).report_dir is None
    assert from_env({}).report_dir is None


def test_report_dir_with_stray_spaces_is_an_error():
    with pytest.raises(ConfigError, match=r"invalid SGLANG_OOBGUARD_REPORT_DIR=' reports'; accepted: a folder path "
                                          "without leading or trailing spaces"):
        from_env({"SGLANG_OOBGUARD_REPORT_DIR": " reports", "SGLANG_OOBGUARD_MODE": "warn"})


# -- SGLANG_OOBGUARD_CHECKS: one check, one switch ------------------------------------------

ON = {"SGLANG_OOBGUARD_MODE": "strict"}
LIVE = {**ON, "SGLANG_OOBGUARD_LIVENESS": "1"}
NAMES = ("bounds", "map", "owners", "liveness", "history", "reads", "ownids", "positions", "finite", "swa", "pd",
         "hicache", "rows", "leaks")


def checks(env):
    return from_env(env).checks


def test_without_the_switch_the_aliases_turn_on_exactly_what_they_did():
    assert checks(ON) == {"bounds", "map", "ownids", "positions", "swa", "hicache"}
    assert checks(LIVE) == checks(ON) | {"liveness", "history", "owners", "reads", "pd", "rows", "leaks"}
    assert checks({**ON, "SGLANG_OOBGUARD_FINITE": "1"}) == checks(ON) | {"finite"}
    cfg = from_env(LIVE)
    assert cfg.liveness and not cfg.finite and not cfg.switched_off
    assert checks({}) == checks(ON) and not from_env({}).liveness  # the guard off: nothing deeper


def test_all_and_minus_apply_left_to_right_and_keep_the_old_fields_true():
    cfg = from_env({**LIVE, "SGLANG_OOBGUARD_CHECKS": "all,-reads"})
    assert cfg.checks == set(NAMES) - {"reads"} and cfg.liveness and cfg.finite
    assert cfg.switched_off == {"reads"}  # what doctor and the activation line call off by the switch
    assert from_env({**ON, "SGLANG_OOBGUARD_CHECKS": "all,-reads"}).switched_off == {"reads"}  # not the aliases'
    assert from_env({**ON, "SGLANG_OOBGUARD_CHECKS": "bounds"}).switched_off == set(NAMES) - {"bounds"}
    assert from_env({**ON, "SGLANG_OOBGUARD_CHECKS": "-ownids"}).switched_off == {"ownids"}  # reads: off by the alias
    assert checks({**LIVE, "SGLANG_OOBGUARD_CHECKS": "all,-reads,+reads"}) == set(NAMES)
    assert checks({**ON, "SGLANG_OOBGUARD_CHECKS": "-all,bounds"}) == {"bounds"}


def test_a_bare_list_starts_from_nothing_and_a_signed_one_edits_the_aliases():
    assert checks({**LIVE, "SGLANG_OOBGUARD_CHECKS": "bounds,map"}) == {"bounds", "map"}
    assert not from_env({**LIVE, "SGLANG_OOBGUARD_CHECKS": "bounds,map"}).liveness
    assert checks({**LIVE, "SGLANG_OOBGUARD_CHECKS": "-reads"}) == checks(LIVE) - {"reads"}
    cfg = from_env({**ON, "SGLANG_OOBGUARD_CHECKS": "+liveness, +FINITE"})  # spaces and any case
    assert cfg.liveness and cfg.finite and cfg.checks == checks(ON) | {"liveness", "finite"}


@pytest.mark.parametrize("value", ["bounds,mapp", "all,-read", "bounds,,map", "+"])
def test_an_unknown_name_is_an_error_listing_every_name(value):
    with pytest.raises(ConfigError) as info:
        from_env({**ON, "SGLANG_OOBGUARD_CHECKS": value})
    message = str(info.value)
    assert f"invalid SGLANG_OOBGUARD_CHECKS={value!r}" in message and "NOT active" in message
    assert "a comma list of all, NAME, +NAME, -NAME with NAME one of " + ", ".join(NAMES) in message


@pytest.mark.parametrize("value,check,needs", [
    ("bounds,reads", "reads", "liveness"),
    ("all,-map", "owners", "map"),
    ("bounds,liveness,owners", "owners", "map"),
    ("bounds,history", "history", "liveness"),
    ("all,-history", "reads", "history"),
    ("bounds,ownids", "ownids", "map"),
    ("bounds,positions", "positions", "map"),
    ("+pd", "pd", "liveness"),
])
def test_a_check_whose_dependency_is_off_is_an_error_naming_what_to_add(value, check, needs):
    with pytest.raises(ConfigError) as info:
        from_env({**ON, "SGLANG_OOBGUARD_CHECKS": value})
    assert f"{check!r} needs {needs!r}, which is off: add '+{needs}'" in str(info.value)


@pytest.mark.parametrize("value", ["-bounds", "all,-bounds", "map,liveness"])
def test_bounds_cannot_be_turned_off_while_the_guard_is_on(value):
    with pytest.raises(ConfigError, match="'bounds' cannot be turned off while the guard is on"):
        from_env({**LIVE, "SGLANG_OOBGUARD_CHECKS": value})


def test_the_switch_without_the_guard_is_an_error_and_explicit_off_wins():
    with pytest.raises(ConfigError, match="SGLANG_OOBGUARD_CHECKS='all'; accepted: unset, or set it with the guard on"):
        from_env({"SGLANG_OOBGUARD_CHECKS": "all"})
    assert not from_env({"SGLANG_OOBGUARD_MODE": "off", "SGLANG_OOBGUARD_CHECKS": "all"}).liveness


def test_checks_on_reads_the_switch():
    from sglang_oobguard.checks.guard import Guard
    from sglang_oobguard.checks.registry import UNITS
    from sglang_oobguard.model.targets import write_map_off

    on = Guard(from_env({**LIVE, "SGLANG_OOBGUARD_CHECKS": "all,-reads,-finite"}), UNITS).checks_on()
    assert "reads" not in on and "finite" not in on and {"bounds", "liveness", "history"} <= set(on)
    if write_map_off() is None:
        assert {"map", "owners", "ownids", "positions"} <= set(on)
