"""The docs are kept true by this test: every settings key is in docs/config.md with its default,
its environment form and its unit; every exported metric, every HTTP endpoint and every CLI flag is
in the docs (metrics and endpoints in docs/, endpoints and commands also on the README's command
lines), and every ``MOEBUS_*`` environment variable the code reads is named in docs/ or the README. A failure
lists exactly what is missing, one line each."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from pydantic import BaseModel

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
UNITS = {"_mib": "MiB", "_s": "s", "_bytes": "bytes"}  # a key's name ends with its unit


def docs_text() -> str:
    return "\n".join(p.read_text() for p in sorted(DOCS.glob("*.md")))


def readme_command_lines() -> list[str]:
    """The README's fenced lines that start with ``moebus`` (continuations joined)."""
    lines, out = ROOT.joinpath("README.md").read_text().splitlines(), []
    for line in lines:
        if line.startswith("moebus "):
            out.append(line)
        elif out and out[-1].rstrip().endswith("\\"):
            out[-1] = out[-1].rstrip()[:-1] + " " + line.strip()
    return out


def report(problems: list[str]) -> str:
    """The failure message: exactly what is missing, one line each."""
    return f"{len(problems)} missing from the docs:\n  " + "\n  ".join(problems)


# -- settings ------------------------------------------------------------------------------------

def settings_keys(model=None, prefix=""):
    """(dotted key, default) for every leaf of the Settings model."""
    from moebus.common.settings import Settings

    model = model or Settings
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            yield from settings_keys(field.annotation, f"{prefix}{name}.")
        else:
            yield prefix + name, field.get_default(call_default_factory=True)


def config_rows() -> dict[str, list[str]]:
    """docs/config.md's table: key -> [default, env, unit, meaning] cells."""
    rows = {}
    for line in (DOCS / "config.md").read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 5 and re.fullmatch(r"`[a-z_.]+`", cells[0]):
            rows[cells[0].strip("`")] = cells[1:]
    return rows


def first_code(cell: str) -> str | None:
    m = re.search(r"`([^`]*)`", cell)
    return m.group(1) if m else None


def default_text(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def test_every_settings_key_is_in_config_md_with_default_env_and_unit():
    rows, problems = config_rows(), []
    for key, default in settings_keys():
        row = rows.get(key)
        if row is None:
            problems.append(f"docs/config.md: no row for settings key `{key}` (default {default_text(default)})")
            continue
        default_cell, env_cell, unit_cell = row[0], row[1], row[2]
        if first_code(default_cell) != default_text(default):
            problems.append(f"docs/config.md: `{key}` default should start with `{default_text(default)}`, "
                            f"it says {default_cell!r}")
        env = "MOEBUS_" + key.upper().replace(".", "__")
        if f"`{env}`" not in env_cell:
            problems.append(f"docs/config.md: `{key}` env form `{env}` missing (the env cell says {env_cell!r})")
        unit = next((u for suffix, u in UNITS.items() if key.endswith(suffix)), None)
        if not unit_cell or (unit and unit not in unit_cell):
            problems.append(f"docs/config.md: `{key}` unit should be {unit or 'given (– when none)'}, "
                            f"it says {unit_cell!r}")
    documented = set(rows) - {k for k, _ in settings_keys()}
    problems += [f"docs/config.md: row for `{k}`, which is no settings key" for k in sorted(documented)]
    if problems:
        pytest.fail(report(problems), pytrace=False)


# -- metrics -------------------------------------------------------------------------------------

def exported_metrics() -> set[str]:
    """Every family /metrics can export: rendered from a full INFO (the broker's real Stats and a
    GPU with every per-GPU field), plus every name metrics.py spells out."""
    from moebus.api import metrics
    from moebus.broker.stats import Stats

    gpu = {"gpu": 0, "ready": True, **{k: 1 for k in metrics.GPU_GAUGES}, **{k: 1 for k in metrics.GPU_COUNTERS}}
    info = {"ready": True, "requests_running": 0, "requests_waiting": 0, **Stats().to_dict(), "gpus": [gpu]}
    text = metrics.render(info).decode()
    names = set(re.findall(r"^# TYPE (\S+) \S+$", text, re.M))
    source = Path(metrics.__file__).read_text()
    names |= {metrics.PREFIX + n for n in re.findall(r'PREFIX \+ "([a-z0-9_]*[a-z0-9])"(?! \+)', source)}
    names |= {metrics.PREFIX + n for n in metrics.HELP}
    names |= {metrics.PREFIX + name for name, _ in metrics.GPU_COUNTERS.values()}
    return names


def test_every_exported_metric_is_in_the_docs():
    text = docs_text()
    missing = sorted(n for n in exported_metrics() if not re.search(rf"`{re.escape(n)}(\{{|`)", text))
    if missing:
        pytest.fail(report([f"docs/: metric `{n}`" for n in missing]), pytrace=False)


# -- environment knobs ---------------------------------------------------------------------------

def environment_knobs() -> set[str]:
    """Every ``MOEBUS_<NAME>`` spelled out in the package's source (a settings key's environment form is one too)."""
    names = set()
    for path in (ROOT / "moebus").rglob("*.py"):
        names |= set(re.findall(r"\bMOEBUS_[A-Z0-9_]*[A-Z0-9]\b", path.read_text()))
    return names


def test_every_environment_knob_is_in_the_docs():
    text = docs_text() + ROOT.joinpath("README.md").read_text()
    found = environment_knobs()
    assert len(found) > 50  # the scan reads the package
    missing = sorted(n for n in found if not re.search(rf"\b{n}\b", text))
    if missing:
        pytest.fail(report([f"docs/ or README: environment variable `{n}`" for n in missing]), pytrace=False)


# -- HTTP endpoints ------------------------------------------------------------------------------

def endpoints() -> set[tuple[str, str]]:
    from moebus.api.app import create_app
    from moebus.common.settings import Settings

    app = create_app(Settings())  # the broker link connects lazily: nothing is contacted
    found = set()
    for rule in app.url_map.iter_rules():
        if rule.endpoint == "static":
            continue
        path = re.sub(r"<[^>]*>", "<>", rule.rule)
        found |= {(m, path) for m in rule.methods - {"HEAD", "OPTIONS"}}
    return found


def test_every_http_endpoint_is_in_api_md_and_the_readme():
    api_md = re.sub(r"<[^>]*>", "<>", (DOCS / "api.md").read_text())
    readme = re.sub(r"<[^>]*>", "<>", ROOT.joinpath("README.md").read_text())
    problems = []
    for method, path in sorted(endpoints(), key=lambda e: (e[1], e[0])):
        if not re.search(rf"`{method}(\|[A-Z]+)* {re.escape(path)}`|`(GET\|)?{method} {re.escape(path)}`", api_md):
            problems.append(f"docs/api.md: `{method} {path}`")
        if f"{path}`" not in readme:
            problems.append(f"README.md: endpoint `{path}`")
    if problems:
        pytest.fail(report(problems), pytrace=False)


# -- command line --------------------------------------------------------------------------------

def cli_flags() -> dict[str, set[str]]:
    """Sub-command -> its long option flags (help aside)."""
    import argparse

    from moebus.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return {name: {s for a in p._actions for s in a.option_strings if s.startswith("--") and s != "--help"}
            for name, p in sub.choices.items()}


def test_every_cli_command_and_flag_is_on_the_readme_command_lines():
    lines = readme_command_lines()
    problems = []
    for command, flags in sorted(cli_flags().items()):
        own = [line for line in lines if re.match(rf"moebus {re.escape(command)}(\s|$)", line)]
        if not own:
            problems.append(f"README.md: no command line for `moebus {command}`")
            continue
        for flag in sorted(flags):
            if not any(re.search(rf"{re.escape(flag)}(?![\w-])", line) for line in own):
                problems.append(f"README.md: `moebus {command} {flag}`")
    if problems:
        pytest.fail(report(problems), pytrace=False)


# -- examples ------------------------------------------------------------------------------------

def test_every_curl_that_sends_a_body_says_it_is_json():
    """The api refuses state-changing bodies that are not application/json (api/cross_site.py), and
    `curl -d` alone sends them form-encoded: each such example must carry the header."""
    problems = []
    for path in [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]:
        text = re.sub(r"\\\n\s*", " ", path.read_text())  # shell continuations joined
        for line in text.splitlines():
            if re.search(r"\bcurl\b.*\s(-d|--data\S*)\s", line) and "Content-Type: application/json" not in line:
                problems.append(f"{path.name}: {line.strip()[:120]}")
    if problems:
        pytest.fail(report(problems), pytrace=False)
