"""``gradwatch config``: the real console script in a subprocess (env, TOML, YAML, JSON, errors)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gradwatch.configfile import ConfigError, load_config, resolve_config

TIMEOUT = 60


def run(*args: str, env: dict[str, str] | None = None, cwd: Path | None = None):  # type: ignore[no-untyped-def]
    """Run ``python -m gradwatch.cli.main ARGS`` with a clean GRADWATCH_* environment."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("GRADWATCH_")}
    base.update(env or {})
    return subprocess.run(
        [sys.executable, "-m", "gradwatch.cli.main", *args],
        env=base,
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("GRADWATCH_"):
            monkeypatch.delenv(key)


def rows(stdout: str) -> dict[str, tuple[str, str]]:
    """The plain-text table (stdout is a pipe): field -> (value, source)."""
    out = {}
    for line in stdout.splitlines()[1:]:
        field, rest = line.split(None, 1)
        value, source = rest.rsplit("  ", 1)
        out[field] = (value.strip(), source.strip())
    return out


TOML = """
port = 9977
every_n_steps = 5
ratios = [["seed", "host"]]
history_path = "runs/history.jsonl"

[groups]
host = ["backbone.*"]
seed = ["seed.*"]
"""

YAML = """
groups:
  host: ["backbone.*"]
  seed: ["seed.*"]
ratios: [[seed, host]]
isolated: [host]
exploding_threshold: 50
port: null
"""


def test_defaults_and_env_with_sources() -> None:
    proc = run("config", env={"GRADWATCH_PORT": "9100", "GRADWATCH_GROUPS": '{"a": ["x.*"]}'})
    assert proc.returncode == 0, proc.stderr
    table = rows(proc.stdout)
    assert table["port"] == ("9100", "env GRADWATCH_PORT")
    assert table["groups"] == ('{"a": ["x.*"]}', "env GRADWATCH_GROUPS")
    assert table["every_n_steps"] == ("1", "default")
    assert "\x1b[" not in proc.stdout  # not a terminal: plain text
    assert set(table) == set(json.loads(run("config", "--json").stdout))


def test_toml_file_and_env_overrides_file(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text(TOML)
    proc = run("config", "--config", str(cfg), env={"GRADWATCH_EVERY_N_STEPS": "7"})
    assert proc.returncode == 0, proc.stderr
    table = rows(proc.stdout)
    assert table["port"] == ("9977", f"file {cfg}")
    assert table["groups"][1] == f"file {cfg}"
    assert table["every_n_steps"] == ("7", "env GRADWATCH_EVERY_N_STEPS")  # env > file
    values = json.loads(run("config", "-c", str(cfg), "--json").stdout)
    assert values["ratios"] == [["seed", "host"]]
    assert values["history_path"] == "runs/history.jsonl"
    assert values["groups"] == {"host": ["backbone.*"], "seed": ["seed.*"]}


def test_yaml_file(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.yaml"
    cfg.write_text(YAML)
    proc = run("config", "--config", str(cfg), "--json")
    assert proc.returncode == 0, proc.stderr
    values = json.loads(proc.stdout)
    assert values["isolated"] == ["host"]
    assert values["exploding_threshold"] == 50.0
    assert values["port"] is None


def test_invalid_env_value_exits_2_naming_field_and_variable() -> None:
    proc = run("config", env={"GRADWATCH_PORT": "abc"})
    assert proc.returncode == 2
    assert "port" in proc.stderr and "GRADWATCH_PORT" in proc.stderr and "'abc'" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    assert proc.stdout == ""


def test_unknown_file_key_exits_2_naming_it(tmp_path: Path) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text("prot = 9977\n")
    proc = run("config", "-c", str(cfg))
    assert proc.returncode == 2
    assert "'prot'" in proc.stderr and "did you mean 'port'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_malformed_and_missing_files_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("port = \n")
    for path, expected in ((bad, "malformed TOML"), (tmp_path / "none.yaml", "cannot read")):
        proc = run("config", "--config", str(path))
        assert proc.returncode == 2, proc.stdout
        assert expected in proc.stderr and str(path) in proc.stderr
        assert "Traceback" not in proc.stderr


@pytest.mark.parametrize(
    ("name", "text", "expected"),
    [
        ("bad.yaml", "groups: [unclosed\n", "malformed YAML"),
        ("bad.json", "{port: 1}", "malformed JSON"),
        ("list.yaml", "- 1\n- 2\n", "must be a mapping"),
        ("gw.ini", "port=1\n", "unknown format"),
        ("bad_value.yaml", "every_n_steps: 0\n", "every_n_steps.*from file"),
        ("cross.toml", 'ratios = [["a", "b"]]\n', "unknown group"),
        ("binary.toml", b"\xff\xfe", "malformed TOML"),
    ],
)
def test_bad_files_raise_config_error(
    tmp_path: Path, name: str, text: str | bytes, expected: str
) -> None:
    """The same errors the command maps to exit 2 (in-process: no interpreter start each)."""
    cfg = tmp_path / name
    if isinstance(text, bytes):
        cfg.write_bytes(text)
    else:
        cfg.write_text(text)
    with pytest.raises(ConfigError, match=expected):
        load_config(cfg)


def test_empty_yaml_is_all_defaults(tmp_path: Path) -> None:
    cfg = tmp_path / "empty.yml"
    cfg.write_text("")
    resolved = resolve_config(cfg)
    assert set(resolved.sources.values()) == {"default"}


def test_unknown_env_variable_is_a_warning() -> None:
    proc = run("config", env={"GRADWATCH_PROT": "1"})
    assert proc.returncode == 0
    assert "GRADWATCH_PROT" in proc.stderr and "GRADWATCH_PORT" in proc.stderr


# -- the library side: what the command shows is what a script gets ---------------------------


def test_load_config_precedence_file_env_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cfg = tmp_path / "gw.toml"
    cfg.write_text("port = 1\nevery_n_steps = 2\ndivergence_every = 3\n")
    monkeypatch.setenv("GRADWATCH_EVERY_N_STEPS", "20")
    monkeypatch.setenv("GRADWATCH_DIVERGENCE_EVERY", "30")
    resolved = resolve_config(cfg, divergence_every=300)
    assert (resolved.config.port, resolved.config.every_n_steps) == (1, 20)
    assert resolved.config.divergence_every == 300
    assert resolved.sources["divergence_every"] == "code"
    assert load_config(cfg).divergence_every == 30
    with pytest.raises(ConfigError, match="unknown key 'prot'"):
        load_config(None, prot=1)


def test_console_script_entry_point() -> None:
    script = Path(sys.executable).parent / "gradwatch"
    if not script.exists():
        pytest.skip("the gradwatch console script is not installed next to this interpreter")
    proc = subprocess.run(
        [str(script), "config", "--json"],
        env={k: v for k, v in os.environ.items() if not k.upper().startswith("GRADWATCH_")},
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["enabled"] is True


@pytest.mark.parametrize(
    ("env", "words"),
    [
        (
            {
                "GRADWATCH_GROUPS": '{"seed": ["s.*"], "host": ["h.*"]}',
                "GRADWATCH_RATIOS": '[{"numerator": "seed", "denominator": "host", "low": 0.3, '
                '"high": 0.2}]',
            },
            ("ratios", "GRADWATCH_RATIOS", "low", "high"),
        ),
        ({"GRADWATCH_RUN_ID": " padded "}, ("run_id", "GRADWATCH_RUN_ID")),
    ],
)
def test_bad_ratio_band_or_run_id_exits_2_naming_the_field(
    env: dict[str, str], words: tuple[str, ...]
) -> None:
    proc = run("config", env=env)
    assert proc.returncode == 2, proc.stdout
    for word in words:
        assert word in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_config_warns_about_a_group_no_parameter_can_join() -> None:
    """A group every pattern of which an earlier group takes first reads 0 forever: warned on
    stderr (exit 0), naming the group and the pattern that takes its parameters."""
    groups = {"all": ["*"], "seed": ["seed.*"], "host": ["backbone.*"], "again": ["backbone.0.w"]}
    result = run("config", env={"GRADWATCH_GROUPS": json.dumps(groups)})
    assert result.returncode == 0, result.stderr
    warnings = [line for line in result.stderr.splitlines() if "can match no parameter" in line]
    assert len(warnings) == 3, result.stderr
    assert "'seed'" in warnings[0] and "group 'all' ('*')" in warnings[0]
    ok = run("config", env={"GRADWATCH_GROUPS": json.dumps({"host": ["backbone.*"], "x": ["b*"]})})
    assert ok.returncode == 0 and "can match no parameter" not in ok.stderr


@pytest.mark.parametrize(
    ("groups", "shadowed"),
    [
        ({"a": ["backbone.*"], "b": ["backbone.0.*"]}, ["b"]),
        ({"a": ["backbone.*"], "b": ["backbone.0.*", "head.*"]}, []),
        ({"a": ["backbone.0.*"], "b": ["backbone.*"]}, []),
        ({"a": ["*.weight"], "b": ["x.weight"], "c": ["x.*"]}, ["b"]),
        ({"a": ["b?ckbone.*"], "b": ["backbone.*"]}, []),  # not provable: not reported
    ],
)
def test_shadowed_groups(groups: dict, shadowed: list[str]) -> None:
    from gradwatch.config import shadowed_groups

    assert list(shadowed_groups(groups)) == shadowed
